"""The baseline users would pick instead: torch DistributedDataParallel, dense ring allreduce.

Same model, data shards, seed, batch size, optimizer and iteration count as a psparse run, so
the two are comparable line by line: ``psparse-launch --baseline ddp ...`` (gloo on CPU, NCCL
on GPU). Rank 0 writes the same run directory files; ``metrics.jsonl`` has ``allreduce_bytes``,
what a ring allreduce of the gradient moves per iteration summed over workers
(2 (N - 1) / N x 4 numel per worker), instead of the psparse server's counts.

``--baseline powersgd`` registers torch's PowerSGD comm hook (Vogels et al. 2019; rank
``--powersgd-rank``, error feedback and warm start on, compression from the second iteration):
each bucket is allreduced as two low-rank factors P and Q (1-D tensors uncompressed).
Per iteration, each rank times its split like a psparse worker (metrics.jsonl on rank 0,
totals in rank-R.json): ``compute_s`` (forward and backward until the gradient bucket is ready,
the optimizer step), ``select_s`` (the comm hook's synchronous part: PowerSGD's first
compression step; ~0 for plain allreduce) and ``wait_s`` (from then until the averaged gradient
is back, including PowerSGD's later steps and the loss average). In cluster modes the ranks meet
at ``--master-addr`` (rank 0's host, which hosts torch's TCPStore).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import RunConfig
from ..options import add_config_arguments, parse_with_config
from ..rundir import (
    EVAL_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    rank_file,
    ring_allreduce_bytes,
    write_atomic,
    write_json,
)
from ..worker.flat_model import FlatModel
from ..worker.local_steps import LocalSteps, outer_step_options
from .loop import make_optimizer, setup
from .loop import train as train_loop


def powersgd_sizes(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0
                   ) -> tuple[int, int, int]:
    """(uncompressed, P, Q) entries that torch's powerSGD_hook allreduces per iteration for
    parameters of these shapes (its own rule: each tensor viewed as shape[0] x rest is
    compressed when (rows + cols) r x min_compression_rate < rows x cols)."""
    u = p = q = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            u += n * m
    return u, p, q


class TimedHook:
    """A DDP comm hook that records when DDP handed it the last bucket (the backward compute
    is done then) and how long its synchronous part took."""

    def __init__(self, hook, state):
        self.hook, self.state = hook, state
        self.__name__ = self.__qualname__ = f"timed_{hook.__name__}"  # DDP logs hook names
        self.last_call = self.last_return = None
        self.sync_s = 0.0
        self.buckets = 0  # how many gradient buckets DDP hands the hook per iteration

    def __call__(self, state, bucket):
        self.buckets = max(self.buckets, bucket.index() + 1)
        self.last_call = time.perf_counter()
        fut = self.hook(self.state, bucket)
        self.last_return = time.perf_counter()
        self.sync_s += self.last_return - self.last_call
        return fut


class AllreduceExchange:
    """The DDP baseline's side of the training loop (psparse.training.loop.train): DDP has already
    averaged the gradients during backward (ring allreduce), so ``exchange`` only averages the
    loss and records the round; rank 0 writes the run directory's files."""

    def __init__(self, cfg: RunConfig, rank: int, numel: int, iterations: int,
                 batches_per_epoch: int, out: Path, backend: str):
        self.cfg, self.rank, self.world = cfg, rank, cfg.workers
        self.start, self.iterations, self.iteration = 0, iterations, 0
        self.batches_per_epoch, self.out, self.backend = batches_per_epoch, out, backend
        self.is_evaluator = rank == 0
        self.numel = numel
        # what the ring moves in iteration it, all workers (train() sets it for the hooks
        # that compress: half for fp16/bf16, PowerSGD's factors after its dense warm-up)
        self.ring_bytes_at = lambda it: ring_allreduce_bytes(self.world, self.numel)
        self.ring_total = 0
        self.timer: TimedHook | None = None  # set by train(): the split of each iteration
        self.local: LocalSteps | None = None  # --local-steps: set by train() (DiLoCo's state)
        self.wire_dtype = None  # the pseudo-gradient's allreduce in bf16/fp16 (those baselines)
        self.baseline = "ddp"
        self.times = {"compute_s": 0.0, "select_s": 0.0, "wait_s": 0.0}
        self.metrics = open(out / METRICS_FILE, "w") if rank == 0 else None
        self.evals = open(out / EVAL_FILE, "w") if rank == 0 else None
        self.last_eval = None
        self.t0 = self.t_round = time.perf_counter()

    def exchange(self, loss) -> None:
        t_back = time.perf_counter()  # backward returned: DDP's averaged gradient is in .grad
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        now = time.perf_counter()
        self._record(mean_loss, self._split(t_back, now), now)

    def local_step(self, loss) -> bool:
        """``--local-steps H``: DiLoCo (LocalSGD with ``--outer-lr 1 --outer-momentum 0``) over
        torch.distributed, the peer of psparse's local steps: every H-th call allreduces the
        dense pseudo-gradient (in bf16 or fp16 with those baselines) and takes the same outer
        step as psparse (worker/local_steps.py). Returns whether it synchronised."""
        local = self.local
        if not local.note_step(loss):
            return False
        mean_loss = local.pseudo_gradient().reshape(1)
        t_ready = time.perf_counter()
        delta = local.net.grad
        wire = delta if self.wire_dtype is None else delta.to(self.wire_dtype)
        dist.all_reduce(wire)
        if wire is not delta:
            delta.copy_(wire)
        delta.div_(self.world)
        dist.all_reduce(mean_loss)
        local.outer_step()
        now = time.perf_counter()
        split = {"compute_s": t_ready - self.t_round, "select_s": 0.0, "wait_s": now - t_ready}
        for key, value in split.items():
            self.times[key] += value
        self._record(mean_loss, split, now)
        return True

    def _split(self, t_back: float, now: float) -> dict:
        """The iteration's compute / select / wait seconds, from the comm hook's clock."""
        split = {}
        if self.timer is not None and self.timer.last_call is not None:
            t = self.timer
            select = t.last_return - t.last_call
            wait = (t_back - t.last_return) + (now - t_back)
            split = {"compute_s": max(0.0, now - self.t_round - select - wait),
                     "select_s": select, "wait_s": wait}
            for key, value in split.items():
                self.times[key] += value
        return split

    def _record(self, mean_loss, split: dict, now: float) -> None:
        """One iteration's metrics.jsonl row (rank 0) and the clock for the next."""
        ring = self.ring_bytes_at(self.iteration)
        self.ring_total += ring
        if self.metrics:
            self.metrics.write(json.dumps({
                "iter": self.iteration, "workers": self.world,
                "allreduce_bytes": ring, "loss": float(mean_loss.sum()) / self.world,
                **{k: round(v, 6) for k, v in split.items()},
                "round_s": round(now - self.t_round, 6), "time_s": round(now - self.t0, 6)})
                + "\n")
            self.metrics.flush()
        self.t_round = now
        self.iteration += 1

    def say(self, text: str) -> None:
        print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)

    def log(self, **values) -> None:
        if self.evals:
            self.last_eval = {"iter": self.iteration - 1, **values,
                              "time_s": round(time.perf_counter() - self.t0, 6)}
            self.evals.write(json.dumps(self.last_eval) + "\n")
            self.evals.flush()

    def close(self, **final) -> None:
        self.log(**final)
        dist.barrier()
        wall = time.perf_counter() - self.t0
        write_atomic(self.out / rank_file(self.rank), json.dumps({
            "rank": self.rank, "iterations": self.iterations, "numel": self.numel,
            "baseline": self.baseline, "wall_s": round(wall, 3),
            "ddp_buckets": self.timer.buckets if self.timer else None,
            **{k: round(v, 4) for k, v in self.times.items()}}, indent=2))
        if self.rank != 0:
            return
        iterations, world, total = self.iterations, self.world, self.ring_total
        write_json(self.out / SUMMARY_FILE, {
            "status": "ok", "error": None, "baseline": f"{self.baseline} ({self.backend})",
            "world_size": world, "numel": self.numel, "k": self.numel,
            "iterations": iterations, "wall_s": round(wall, 3),
            "iterations_per_s": round(iterations / wall, 3),
            "union_over_k_mean": None, "union_over_k_max": None,
            "upload_mb": round(total / 2e6, 4),
            "broadcast_mb": round(total / 2e6, 4),
            "dense_mb": round(iterations * 2 * world * self.numel * 4 / 1e6, 4),
            "allreduce_mb": round(iterations * ring_allreduce_bytes(world, self.numel) / 1e6, 4),
            "final_loss": None, "test_acc": self.last_eval["test_acc"],
            "test_loss": self.last_eval["test_loss"], "rejected_messages": 0,
            "ddp_buckets": self.timer.buckets if self.timer else None})
        self.metrics.close()
        self.evals.close()


BASELINES = ("ddp", "fp16", "bf16", "powersgd")


def local_steps_name(cfg: RunConfig, baseline: str) -> str:
    """A --local-steps baseline's name: LocalSGD (parameter averaging: the outer step plain
    SGD at learning rate 1) or DiLoCo, with its H and the allreduce's value format."""
    lr, momentum = outer_step_options(cfg)
    kind = "localsgd" if (lr, momentum) == (1, 0) else f"diloco-olr{lr:g}-om{momentum:g}"
    return f"{kind}-h{cfg.local_steps}" + ("" if baseline == "ddp" else f"-{baseline}")
POWERSGD_WARMUP = 1000  # torch's start_powerSGD_iter default: dense allreduce before it


def train(cfg: RunConfig, rank: int, port: int, out: Path, baseline: str = "ddp",
          powersgd_rank: int = 4, master_addr: str | None = None,
          powersgd_warmup: int = POWERSGD_WARMUP) -> int:
    world = cfg.workers
    data, shard, model, _, device = setup(cfg, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if master_addr:
        os.environ["MASTER_ADDR"] = master_addr
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout * 10))
    if baseline == "powersgd":
        # One bucket for the whole model: torch's PowerSGD hook issues each bucket's second
        # allreduce (Q) from the first one's callback, so with several buckets the ranks can
        # issue the buckets' collectives in different orders, which gloo aborts on ("Received
        # data size doesn't match expected size": ResNet-20, 1.09 MB, is two buckets by DDP's
        # defaults). An explicit cap also sets DDP's first-bucket cap (default 1 MiB).
        model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
        ddp = DistributedDataParallel(model, bucket_cap_mb=model_mib + 1)
    elif cfg.local_steps == 1:
        ddp = DistributedDataParallel(model)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if baseline == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        # a dense allreduce for the first powersgd_warmup iterations (torch's guidance and
        # default, 1000; at least 2 with error feedback), compressed from then on
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=powersgd_rank,
                                       start_powerSGD_iter=powersgd_warmup,
                                       use_error_feedback=True, warm_start=True,
                                       random_seed=cfg.seed)
        timer = TimedHook(powersgd.powerSGD_hook, state)
    elif baseline in ("fp16", "bf16"):  # DDP's own compression: the bucket cast for the ring
        hook = default_hooks.fp16_compress_hook if baseline == "fp16" else \
            default_hooks.bf16_compress_hook
        timer = TimedHook(hook, None)
    else:
        timer = TimedHook(default_hooks.allreduce_hook, None)  # what DDP does by default
    opt = make_optimizer(cfg, model, memory_momentum=False)  # DDP keeps no DGC memory
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    iterations = cfg.iterations or math.ceil(cfg.epochs_or_default() * shard.batches_per_epoch
                                             / cfg.local_steps)
    exchange = AllreduceExchange(cfg, rank, numel, iterations, shard.batches_per_epoch, out,
                                 backend)
    exchange.baseline = {"ddp": "ddp", "fp16": "ddp-fp16-compress",
                         "bf16": "ddp-bf16-compress"}.get(
        baseline, f"powersgd-r{powersgd_rank}-warmup{powersgd_warmup}")
    if cfg.local_steps > 1:  # DiLoCo's peer: no allreduce in backward, the model unwrapped
        exchange.local = LocalSteps(FlatModel(model, device), cfg)
        exchange.wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(baseline)
        exchange.baseline = local_steps_name(cfg, baseline)
        timer = None
    else:
        ddp.register_comm_hook(None, timer)
    exchange.timer = timer
    dense = ring_allreduce_bytes(world, numel)
    if baseline in ("fp16", "bf16"):  # 2 bytes an entry on the ring
        exchange.ring_bytes_at = lambda it: dense // 2
    elif baseline == "powersgd":  # the ring moves PowerSGD's factors after the warm-up
        entries = sum(powersgd_sizes([tuple(p.shape) for p in model.parameters()
                                      if p.requires_grad], powersgd_rank))
        compressed = int(2 * (world - 1) / world * 4 * entries * world)
        exchange.ring_bytes_at = lambda it: dense if it < powersgd_warmup else compressed
    if rank == 0:  # the process group and DDP are up: training starts (experiments/cluster.py)
        exchange.say(f"process group ready: {world} ranks, baseline {exchange.baseline}")
    train_loop(cfg, exchange, model, opt, shard, data, device,
               forward=model if cfg.local_steps > 1 else ddp)
    # No destroy_process_group(): with gloo it can hang when the other ranks are already
    # leaving (seen once in CI); the process ends right after, which releases everything.
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psparse.training.ddp",
                                description="One rank of the DistributedDataParallel baseline "
                                            "(started by psparse-launch --baseline ddp).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the process group's TCP port")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--baseline", choices=BASELINES, default="ddp")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-warmup", type=int, default=POWERSGD_WARMUP)
    p.add_argument("--master-addr", default=None,
                   help="rank 0's host, where the ranks meet (default $MASTER_ADDR, else "
                        "127.0.0.1)")
    add_config_arguments(p)
    return p


def main(argv=None) -> int:
    args, cfg = parse_with_config(build_parser(), argv)
    return train(cfg, args.rank, args.port, args.out, args.baseline, args.powersgd_rank,
                 args.master_addr, args.powersgd_warmup)


if __name__ == "__main__":
    sys.exit(main())
