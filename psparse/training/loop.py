"""psparse-worker: the built-in training loop, the first user of ``psparse.worker.session``.

Per iteration (``train``):
  1. forward/backward on this rank's next minibatch (the gradient lands in one flat buffer);
  2. ``session.exchange(loss)``: accumulator += gradient (error feedback), the selection policy
     picks k entries, push, receive the aggregate (the mean of all pushes at the union of their
     indices) into the parameters' ``.grad``;
  3. the learning-rate schedule and ``optimizer.step()``; evaluation every ``--eval-every``.
With ``--local-steps H`` an iteration is H forward/backward/``optimizer.step()`` on this rank's
own batches, then ``session.local_step(loss)`` synchronises: the weights' change goes through the
same exchange, and the outer step sets the weights every rank shares (worker/local_steps.py).

Every replica applies the same bytes with the same optimizer from the same seeded weights, so all
replicas stay bit-identical; workers send a weight checksum every ``check_every`` iterations and
at the end, and the server stops the run if they differ. The same loop trains the DDP baseline
(``psparse.training.ddp``), with an exchange that is DDP's allreduce.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ConfigError, RunConfig
from ..data import DataError, Shard, load_dataset, test_batches
from ..options import add_config_arguments, resolve_config
from ..policies import PolicyError
from ..worker import environment
from ..worker.client import ServerGone, WorkerError, report_failure
from ..worker.divergence import loss_diverged
from ..worker.flat_model import pick_device
from ..worker.session import Session, failure_cause
from . import schedule
from .models import build_model
from .optim import FrozenVarianceAdamW

__all__ = ["train", "evaluate_model", "WorkerError", "ServerGone", "main"]


def train(cfg: RunConfig, session, model: torch.nn.Module, optimizer, shard: Shard, data,
          device: torch.device, forward=None, precision: Precision | None = None) -> None:
    """The training loop, for any ``session`` with psparse's exchange interface (``start``,
    ``iterations``, ``is_evaluator``, ``exchange(loss)``, ``log(**values)``, ``close(**final)``,
    ``say(text)``): a psparse Session, or the DDP baseline's AllreduceExchange. ``forward`` is
    the module to call (DDP's wrapper); the model itself by default. ``precision``: --amp and
    --channels-last (the one whose GradScaler the session was given)."""
    forward = forward or model
    precision = precision or Precision(cfg.amp, cfg.channels_last, device)
    if session.is_evaluator and precision.emulated():
        session.say(EMULATED_BF16)
    local = cfg.local_steps  # H batches an iteration; 1: the exchange is the gradient's
    t0 = time.perf_counter()
    for it in range(session.start, session.iterations):
        for step in range(it * local, (it + 1) * local):
            model.train()
            x, y = shard.batch(step)
            x = precision.images(x.to(device, non_blocking=True))
            y = y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=False)
            with precision.autocast():
                loss = F.cross_entropy(forward(x), y)
            if not torch.isfinite(loss):
                raise loss_diverged(step, loss.item(), "lower --lr, or use --clip-norm")
            precision.backward(loss)
            if local == 1:
                session.exchange(loss)
            if schedule.varies(cfg):
                for group in optimizer.param_groups:
                    group["lr"] = schedule.learning_rate(cfg, step, shard.batches_per_epoch,
                                                         session.iterations * local)
            precision.step(optimizer, cfg.clip_aggregate)
            if local > 1:  # the last of the H steps synchronises (local steps' outer step)
                session.local_step(loss)
        done = it + 1
        if session.is_evaluator and cfg.eval_every and done % cfg.eval_every == 0 \
                and done < session.iterations:
            session.log(**evaluate(model, data, device, done * local - 1,
                                    shard.batches_per_epoch, cfg.eval_samples, precision))
    session.say(f"{session.iterations} iterations in {time.perf_counter() - t0:.1f} s")
    final = evaluate(model, data, device, session.iterations * local - 1,
                     shard.batches_per_epoch, cfg.eval_samples, precision) \
        if session.is_evaluator else {}
    session.close(**final)


# bench_amp's one ResNet-20 step (batch 32, one thread) on an AMD EPYC with AVX2 only: float32
# 276 ms, bf16 autocast 4,259 ms, bf16 + channels-last 2,637 ms (AVX512-BF16/AMX CPUs: 2.4x
# faster than float32, docs/notes/bench-amp.md)
EMULATED_BF16 = ("--amp bf16 on a CPU without AVX512-BF16 or AMX: bf16 convolutions and "
                 "matrix products are emulated there, about 10-15x slower than float32 (measured "
                 "on ResNet-20); leave --amp out on this machine, or train on one with bf16 "
                 "support")


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 in hardware (the avx512_bf16 or amx_bf16 flag of
    /proc/cpuinfo, or of the text given); True where that cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags")
             for flag in line.partition(":")[2].split()}
    return not flags or bool({"avx512_bf16", "amx_bf16"} & flags)


class Precision:
    """The built-in loop's --amp and --channels-last: how a batch enters the model, the
    forward's autocast, and backward and step through a GradScaler for fp16 (its scale is the
    same on every rank: psparse's exchange ORs a worker's overflow into the round's aggregate,
    DDP's allreduce carries the inf, so every rank skips the same steps; worker/amp.py)."""

    def __init__(self, amp: str | None, channels_last: bool, device: torch.device):
        self.device_type = device.type
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
        self.memory_format = torch.channels_last if channels_last else None
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def emulated(self) -> bool:
        """bf16 autocast on a CPU that emulates bf16 (far slower than float32: EMULATED_BF16)."""
        return self.dtype is torch.bfloat16 and self.device_type == "cpu" and not native_bf16()

    def images(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory_format is not None and x.dim() == 4:
            return x.contiguous(memory_format=self.memory_format)
        return x

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer, clip: float | None = None) -> None:
        """The optimizer's step on the aggregate in ``.grad``, clipped to L2 norm ``clip``
        first if given (under a GradScaler unscaled first: the AMP recipe)."""
        if clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip)
        if self.scaler is None:
            optimizer.step()
        else:  # skips the step when the (exchanged) gradient holds an inf; the same on all ranks
            self.scaler.step(optimizer)
            self.scaler.update()


def evaluate(model, data, device, it: int, batches_per_epoch: int,
             samples: int | None = None, precision: Precision | None = None) -> dict:
    test_loss, test_acc = evaluate_model(model, data, device, samples, precision)
    return {"epoch": round((it + 1) / batches_per_epoch, 4), "test_loss": test_loss,
            "test_acc": test_acc}


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, data, device: torch.device,
                   samples: int | None = None,
                   precision: Precision | None = None) -> tuple[float, float]:
    """(mean test loss, test accuracy) over the whole test set, or over a fixed random subset
    of ``samples`` test images, with the training's autocast and memory format."""
    model.eval()
    precision = precision or Precision(None, False, device)
    loss_sum, correct, n = 0.0, 0, 0
    with eval_threads(device):
        for x, y in test_batches(data, samples=samples):
            x, y = precision.images(x.to(device)), y.to(device)
            with precision.autocast():
                out = model(x)
            loss_sum += float(F.cross_entropy(out.float(), y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += y.numel()  # images: one label each; text: one per character
    return loss_sum / n, correct / n


@contextlib.contextmanager
def eval_threads(device: torch.device):
    """On the CPU, evaluate with every core this process may run on: the other ranks wait
    for the evaluator's round meanwhile, so the cores their training threads use are idle
    (8 workers on 2 cores: one thread each; a whole CIFAR-10 test pass of ResNet-20 took 5.7 s
    on one, 11% of an epoch's training, benchmarks/bench_amp.py). Restores the thread count."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        torch.set_num_threads(max(threads, cores))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def setup(cfg: RunConfig, rank: int):
    """Data, shard, seeded model and optimizer as every rank builds them (the same initial
    weights everywhere): (data, shard, model, optimizer, device)."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers))
    data = load_dataset(cfg.dataset, cfg.data_dir)
    shard = Shard(data, rank, cfg.workers, cfg.batch_size, cfg.seed)
    torch.manual_seed(cfg.seed)  # same initial weights on every worker
    device = pick_device(cfg.device, rank)
    model = build_model(cfg.model, data.in_shape, data.num_classes,
                        cfg.model_kwargs()).to(device)
    if cfg.channels_last:  # the flat buffers make parameters contiguous again (FlatModel);
        model = model.to(memory_format=torch.channels_last)  # the batches carry the format
    return data, shard, model, make_optimizer(cfg, model), device


def make_optimizer(cfg: RunConfig, model: torch.nn.Module,
                   memory_momentum: bool | None = None) -> torch.optim.Optimizer:
    """The built-in loop's optimizer (a --baseline run's too): SGD with --lr, --momentum,
    --nesterov and --weight-decay, or AdamW (--optimizer adamw) with --lr and --weight-decay
    (its second moment frozen after --dense-warmup with --freeze-variance).
    With DGC's or the adam memory the momentum (and Adam's step) is applied locally, in the
    memory, so the aggregate is applied by plain SGD (for plain SGD, weight decay is AdamW's
    decoupled decay); ``memory_momentum`` False: no such memory (DDP)."""
    in_memory = cfg.memory in ("dgc", "adam") if memory_momentum is None else memory_momentum
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw" and not in_memory:
        if cfg.freeze_variance:  # frozen at the end of the dense warm-up (1-bit Adam)
            return FrozenVarianceAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                       freeze_after=cfg.dense_warmup)
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    momentum = 0.0 if in_memory else cfg.momentum
    return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.nesterov and momentum > 0)


def run_worker(cfg: RunConfig, rank: int, server, out_dir: Path | None = None,
               save_weights: Path | None = None, resume: bool = False,
               run_token: str | None = None) -> int:
    try:
        data, shard, model, optimizer, device = setup(cfg, rank)
        # iterations: exchanges; with --local-steps H, synchronisations of H batches each
        iterations = cfg.iterations or math.ceil(cfg.epochs_or_default() *
                                                 shard.batches_per_epoch / cfg.local_steps)
        precision = Precision(cfg.amp, cfg.channels_last, device)
        session = Session(model, optimizer, cfg, rank=rank, server=server,
                          iterations=iterations, batches_per_epoch=shard.batches_per_epoch,
                          out_dir=out_dir, run_token=run_token, resume=resume, device=device,
                          scaler=precision.scaler if cfg.local_steps == 1 else None)
    except Exception as exc:  # not registered: tell the server why, for summary.json
        report_failure(server if isinstance(server, list) else [server], rank, cfg.workers,
                       failure_cause(exc), run_token=run_token, curve_keys=cfg.curve_keys)
        raise
    try:
        session.say("model and data ready; registering")
        session.register()
        train(cfg, session, model, optimizer, shard, data, device, precision=precision)
    except BaseException as exc:
        session.fail(exc)  # the cause reaches summary.json (unless the server is gone)
        raise
    if save_weights:
        torch.save(model.state_dict(), save_weights)
    return 0


def parse_endpoint(text: str) -> tuple[str, int] | list[tuple[str, int]]:
    """``--connect``: one HOST:PORT, or a list of them (key-range server shards, in order)."""
    try:
        servers = environment.parse_servers(text)
    except ValueError:
        raise ValueError(f"--connect must be HOST:PORT (or HOST:PORT,HOST:PORT,... for server "
                         f"shards, in shard order), got {text!r}") from None
    return servers[0] if len(servers) == 1 else servers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psparse-worker",
        description="Run one psparse training worker: trains its shard, pushes the top-k of its "
                    "error-feedback accumulator to the server at --connect every iteration and "
                    "applies the aggregate it gets back. All workers of a run need the same "
                    "configuration.")
    p.add_argument("--rank", type=int, default=None,
                   help="this worker's rank, 0..workers-1 (default: from RANK, SLURM_PROCID, "
                        "PMI_RANK or OMPI_COMM_WORLD_RANK)")
    p.add_argument("--connect", default=None,
                   help="server address HOST:PORT, or every key-range server shard's, "
                        "comma-separated in shard order (default: $PSPARSE_SERVER, else "
                        "$MASTER_ADDR:$PSPARSE_PORT (5555), else 127.0.0.1:5555)")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory: writes rank-R.json (bytes, timings, final checksum)")
    p.add_argument("--save-weights", type=Path, default=None,
                   help="save the final model state_dict here (torch.save)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out that all processes saved")
    p.add_argument("--world-size", type=int, dest="workers", default=None,
                   help="alias of --workers")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="the run's secret, proven in the register (HMAC) when the server has "
                        "one (default: $PSPARSE_TOKEN)")
    add_config_arguments(p)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rank is None:
        args.rank = environment.rank_from_env()
        if args.rank is None:
            p.error("--rank is required (or set RANK / SLURM_PROCID)")
    if args.workers is None and args.config is None:
        args.workers = environment.world_size_from_env()
    try:
        cfg = resolve_config(args)
        server = parse_endpoint(args.connect or environment.server_from_env() or
                                "127.0.0.1:5555")
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    try:
        return run_worker(cfg, args.rank, server, args.out, args.save_weights, args.resume,
                          run_token=args.run_token or os.environ.get("PSPARSE_TOKEN") or None)
    except (WorkerError, DataError, PolicyError, ConfigError) as exc:
        print(f"psparse-worker[{args.rank}]: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
