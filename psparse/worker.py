"""A training worker: local gradient, error-feedback accumulator, sparse push, apply the aggregate.

Per iteration:
  1. forward/backward on this rank's next minibatch (the gradient lands in one flat buffer);
  2. accumulator += gradient (error feedback: what is not sent now is sent later; ``memory.py``);
  3. the selection policy picks k entries of the accumulator (``policies/``; two-phase policies
     first exchange proposed indices through the server); push (indices, values), zero them;
  4. receive the aggregate (mean of all pushes at the union of their indices), show it to the
     policy, write it into the parameters' ``.grad`` and step SGD.

Every replica applies the same bytes with the same optimizer from the same seeded weights, so all
replicas stay bit-identical; workers send a weight checksum every ``check_every`` iterations and
at the end, and the server stops the run if they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import zmq

from . import checkpoint, cluster, protocol
from .codec import KeyCache
from .config import ConfigError, RunConfig, add_config_arguments, resolve_config
from .data import DataError, Shard, load_dataset, test_batches
from .locality import SelectionRecorder
from .memory import Memory, density_schedule
from .models import build_model
from .policies import Layout, PolicyError, build_policy, check_output
from .protocol import ProtocolError
from .sparsify import NonFiniteError, density_to_k, topk_exact
from .transport import Channel, TransportTimeout
from .xp import CUPY_HINT, cupy_or_none, from_torch, to_device, to_host


class WorkerError(RuntimeError):
    """This worker cannot go on; the text says why."""


class ServerGone(WorkerError):
    """The server ended the run or cannot be reached: there is nobody to report a cause to."""


class FlatModel:
    """A model whose parameters and gradients are views into two flat float32 buffers.

    Backward writes gradients straight into ``grad`` and the optimizer updates ``params`` in
    place, so the worker reads and writes whole-model vectors with no gather/scatter copies.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None):
        device = device or torch.device("cpu")
        self.model = model.to(device)
        self.device = device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.layer_names = [n for n, _ in named]
        params = [p for _, p in named]
        self.layer_sizes = [p.numel() for p in params]
        self.numel = sum(self.layer_sizes)
        self.params = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # Without CuPy a GPU gradient crosses to the host once per iteration, into pinned memory
        # (allocated on first use); with CuPy it stays on the device (``grad_array``).
        self.host_grad = self.grad if device.type == "cpu" else None
        offset = 0
        for p, n in zip(params, self.layer_sizes):
            self.params[offset:offset + n].copy_(p.data.view(-1))
            p.data = self.params[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            offset += n
        self.parameters = params

    def checksum(self) -> str:
        return hashlib.blake2b(self.params.cpu().numpy().data, digest_size=8).hexdigest()

    def grad_array(self, xp=np):
        """The gradient as an array of ``xp``: a CuPy view of the CUDA tensor (no copy), or a
        numpy array (the CPU tensor's own memory, or a pinned host copy of a CUDA gradient)."""
        if xp is not np:
            return from_torch(self.grad)
        if self.host_grad is None:
            self.host_grad = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
        if self.host_grad is not self.grad:
            self.host_grad.copy_(self.grad)
        return self.host_grad.numpy()

    def set_grad(self, indices: np.ndarray | None, values: np.ndarray) -> None:
        """The aggregate into .grad: dense values, or values at indices (zeros elsewhere)."""
        if self.device.type == "cpu":
            grad = self.grad.numpy()
            if indices is None:
                grad[:] = values
            else:
                grad[:] = 0.0
                grad[indices] = values
            return
        vals = torch.from_numpy(np.asarray(values)).to(self.device)
        if indices is None:
            self.grad.copy_(vals)
        else:
            self.grad.zero_()
            self.grad[torch.from_numpy(np.asarray(indices, dtype=np.int64)).to(self.device)] = vals


class Heartbeat(threading.Thread):
    """Tells the server this worker is alive while it computes, evaluates or waits.

    Its own connection (ZeroMQ sockets are not thread-safe), carrying the rank and the token the
    server handed out in "ready", so nobody else can keep a rank alive. A frozen or killed
    process stops beating and the server declares it lost after --timeout.
    """

    def __init__(self, host: str, port: int, cfg: RunConfig, rank: int, token: str,
                 interval: float):
        super().__init__(name=f"heartbeat-{rank}", daemon=True)
        self.channel = Channel.client(host, port, send_timeout_s=interval,
                                      curve_keys=cfg.curve_keys, key_name=f"worker-{rank}")
        self.beat = protocol.encode("heartbeat", rank=rank, token=token)
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.channel.send(self.beat)
                self._stop_event.wait(self.interval)
        except (TransportTimeout, zmq.ZMQError):
            pass  # the server is gone; the main thread notices through its own timeout

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2 * self.interval)
        self.channel.close(linger_s=0)


class Worker:
    def __init__(self, cfg: RunConfig, rank: int, host: str, port: int,
                 out_dir: str | Path | None = None, save_weights: str | Path | None = None,
                 resume: bool = False, run_token: str | None = None):
        if not 0 <= rank < cfg.workers:
            raise WorkerError(f"rank {rank} out of range [0, {cfg.workers})")
        self.cfg, self.rank = cfg, rank
        self.run_token = run_token  # proves this worker belongs to the run (register's HMAC)
        self.live = list(range(cfg.workers))  # ranks still in the run (elastic runs lose some)
        self.host, self.port = host, port
        self.heartbeat: Heartbeat | None = None
        self._t_created = time.perf_counter()
        self.out_dir = Path(out_dir) if out_dir else None
        self.save_weights = Path(save_weights) if save_weights else None
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers))
        self.data = load_dataset(cfg.dataset, cfg.data_dir)
        self.shard = Shard(self.data, rank, cfg.workers, cfg.batch_size, cfg.seed)
        torch.manual_seed(cfg.seed)  # same initial weights on every worker
        self.device = pick_device(cfg.device, rank)
        self.net = FlatModel(build_model(cfg.model, self.data.in_shape, self.data.num_classes),
                             self.device)
        # the GPU path: accumulator, selection and policy state on the device (CuPy kernels)
        self.xp = gpu_array_module(self.device, self.log)
        self.memory = Memory(self.net.numel, cfg.memory, cfg.momentum, cfg.clip_norm,
                             xp=self.xp)
        self.outbox = HostBuffers()  # pinned host copies of the k pairs (GPU path)
        # With DGC the momentum is applied locally (in the memory), so SGD must not add more.
        momentum = cfg.momentum if self.memory.optimizer_momentum_applies else 0.0
        self.optimizer = torch.optim.SGD(self.net.parameters, lr=cfg.lr, momentum=momentum,
                                         weight_decay=cfg.weight_decay)
        self.k = density_to_k(cfg.density, self.net.numel)
        self.policy = build_policy(cfg.policy, cfg.policy_args,
                                   Layout(self.net.layer_sizes, cfg.granularity),
                                   self._k_at(0), rank=rank, world_size=cfg.workers,
                                   seed=cfg.seed, xp=self.xp)
        self.index_dtype = np.dtype(protocol.index_dtype_for(self.net.numel))
        self.cache = KeyCache()  # index sets this worker and the server both hold
        self.recorder = SelectionRecorder(self.net.layer_sizes, self.net.layer_names) \
            if cfg.record_selections else None
        self.iterations = cfg.iterations or math.ceil(cfg.epochs * self.shard.batches_per_epoch)
        try:
            self.channel = Channel.client(host, port, send_timeout_s=cfg.timeout,
                                          max_message_bytes=int(cfg.max_message_mb * 1e6),
                                          curve_keys=cfg.curve_keys, key_name=f"worker-{rank}")
        except OSError as exc:
            raise WorkerError(str(exc)) from None
        self.stats = {"push_bytes": 0, "aggregate_bytes": 0, "compute_s": 0.0, "select_s": 0.0,
                      "wait_s": 0.0}
        self.start = 0
        self.last_report: tuple[int, dict] | None = None  # rank 0's latest evaluation sent
        if resume:
            self._restore()

    def log(self, msg: str) -> None:
        print(f"[rank {self.rank} +{time.perf_counter() - self._t_created:.1f}s] {msg}",
              file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------- messages
    def _send(self, frames) -> int:
        try:
            return self.channel.send(frames)
        except TransportTimeout as exc:
            raise ServerGone(f"lost the server: {exc}") from None

    @property
    def evaluator(self) -> int:
        """The rank that evaluates: rank 0, or the lowest live rank once rank 0 was lost."""
        return min(self.live)

    def _expect(self, msg_type: str, what: str, it: int | None = None) -> protocol.Message:
        """Wait for the server's next ``msg_type``; server errors and shutdowns end the run."""
        deadline = time.monotonic() + self.cfg.timeout
        while True:
            remaining = deadline - time.monotonic()
            got = self.channel.recv(remaining) if remaining > 0 else None
            if got is None:
                raise ServerGone(f"no {what} from the server within {self.cfg.timeout:g} s "
                                  "(server gone or stalled)")
            _, frames, nbytes = got
            try:
                msg = protocol.decode(frames, numel=self.net.numel, cache=self.cache)
            except ProtocolError as exc:
                raise WorkerError(f"malformed message from the server: {exc}") from None
            if msg.type == "heartbeat":  # the server is alive, just waiting for others
                deadline = time.monotonic() + self.cfg.timeout
                continue
            if msg.type == "error":
                raise WorkerError(f"the server rejected our message: {msg['message']}")
            if msg.type == "shutdown":
                if msg["ok"] and msg_type == "shutdown":
                    return msg
                raise ServerGone(f"the server ended the run: {msg['reason']}")
            if msg.type != msg_type or (it is not None and msg["iter"] != it):
                raise WorkerError(f"expected {what}, got {msg.type} "
                                  f"{msg.get('iter', '')}".rstrip())
            msg.extra["nbytes"] = nbytes
            return msg

    # -------------------------------------------------------------------------------- training
    def run(self) -> int:
        self.log("model and data ready; registering")
        self.register()
        try:
            return self._train()
        except ServerGone:
            raise
        except Exception as exc:  # any other cause: the run's summary.json must name it
            cause = str(exc) if isinstance(exc, (WorkerError, PolicyError)) \
                else f"{type(exc).__name__}: {exc}"
            self._give_up(cause)
            raise

    def _give_up(self, cause: str) -> None:
        """Tell the server why this worker stops, and wait (briefly) for its acknowledging
        shutdown, so that the cause is in summary.json before this process exits."""
        try:
            self.channel.send(protocol.encode("error", message=cause, rank=self.rank))
        except (TransportTimeout, zmq.ZMQError):
            return
        deadline = time.monotonic() + min(self.cfg.timeout, 10.0)
        while (remaining := deadline - time.monotonic()) > 0:
            got = self.channel.recv(remaining)
            if got is None:
                return
            try:
                if protocol.decode(got[1], numel=self.net.numel).type == "shutdown":
                    return
            except ProtocolError:
                continue  # e.g. an index set cached on a connection we no longer track

    def _train(self) -> int:
        t0 = time.perf_counter()
        if self.last_report is not None and self.last_report[0] == self.start - 1:
            self.report(*self.last_report)  # the server may not have written it before the stop
        for it in range(self.start, self.iterations):
            try:
                self.step(it)
            except NonFiniteError as exc:  # selection refuses an accumulator with NaN or inf
                raise WorkerError(f"training diverged at iteration {it}: {exc}") from None
            done = it + 1
            if self.rank == self.evaluator and self.cfg.eval_every \
                    and done % self.cfg.eval_every == 0 \
                    and done < self.iterations:
                self.last_report = (it, self.evaluate(it))
                self.report(*self.last_report)
            if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0 \
                    and done < self.iterations:
                self._checkpoint(done)
        self.log(f"{self.iterations} iterations in {time.perf_counter() - t0:.1f} s")
        values = self.evaluate(self.iterations - 1) if self.rank == self.evaluator else {}
        self.report(self.iterations - 1, {**values, "final": True}, self.net.checksum())
        self._expect("shutdown", "the end-of-run shutdown")
        self.finish(time.perf_counter() - t0)
        return 0

    def register(self) -> None:
        proof = {}
        if self.run_token:
            nonce = secrets.token_hex(16)
            proof = {"nonce": nonce, "proof": protocol.register_proof(
                self.run_token, self.rank, self.cfg.workers, nonce)}
        self._send(protocol.encode(
            "register", rank=self.rank, world_size=self.cfg.workers, run=self.describe_run(),
            checksum=self.net.checksum(), start=self.start, **proof))
        ready = self._expect("ready", "the ready signal (all workers registered)")
        if ready["heartbeat_s"] > 0:
            self.heartbeat = Heartbeat(self.host, self.port, self.cfg, self.rank, ready["token"],
                                       ready["heartbeat_s"])
            self.heartbeat.start()
        self.log(f"registered: numel={self.net.numel} k={self.k} iterations={self.iterations} "
                 f"policy={self.policy.describe()} memory={self.cfg.memory}")

    def describe_run(self) -> dict:
        """The run description every rank must agree on (docs/protocol.md, "The run"): model
        size, length, round kind, the budget steps (the server enforces them) and the shared
        options."""
        return {"numel": self.net.numel, "iterations": self.iterations,
                "two_phase": self.policy.two_phase, "steps": self.budget_steps(),
                "config": self.cfg.agreed()}

    def budget_steps(self) -> list[list[int]]:
        """[from_iteration, budget, push_max, propose_max] wherever the budget changes (only
        during a density warm-up); push_max and propose_max are what the policy declares for
        that budget."""
        steps = []
        for it in range(self.iterations if self.cfg.density_warmup else 1):
            k = self._k_at(it)
            if not steps or steps[-1][1] != k:
                self.policy.set_k(k)
                steps.append([it, k, self.policy.max_push, self.policy.max_propose])
        self.policy.set_k(self._k_at(self.start))
        return steps

    # ---------------------------------------------------------------------- checkpoint, resume
    def _checkpoint(self, iteration: int) -> None:
        if not self.out_dir:
            raise WorkerError("--checkpoint-every needs the run directory (--out)")
        checkpoint.save(self.out_dir, f"rank-{self.rank}", iteration, {
            "iteration": iteration,
            "model": self.net.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "memory": {name: to_host(a) for name, a in self.memory.state_dict().items()},
            "policy": {name: to_host(v) if hasattr(v, "shape") else v
                       for name, v in self.policy.state_dict().items()},
            "cache": self.cache.state(),
            "stats": self.stats,
            "last_report": self.last_report,
        })

    def _restore(self) -> None:
        if not self.out_dir:
            raise WorkerError("--resume needs the run directory (--out)")
        start = checkpoint.latest_common(self.out_dir, self.cfg.workers)
        if start is None:
            raise WorkerError(f"no checkpoint in {self.out_dir} that the server and all "
                              f"{self.cfg.workers} workers saved")
        state = checkpoint.load(self.out_dir, f"rank-{self.rank}", start)
        with torch.no_grad():  # copies into the flat buffers the parameters view
            self.net.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, array in state["memory"].items():
            getattr(self.memory, name)[...] = self.xp.asarray(array)
        self.policy.load_state_dict(state["policy"])
        self.cache.restore(state["cache"])
        self.stats.update(state["stats"])
        self.last_report = state["last_report"]
        self.start = start
        self.log(f"resuming at iteration {start}")

    def _k_at(self, it: int) -> int:
        """Entries to send at iteration ``it`` (the density warm-up lowers it epoch by epoch)."""
        epoch = it / self.shard.batches_per_epoch
        density = density_schedule(self.cfg.density, self.cfg.density_warmup, epoch)
        return density_to_k(density, self.net.numel)

    def step(self, it: int) -> None:
        t = time.perf_counter()
        self.net.model.train()
        x, y = self.shard.batch(it)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.net.grad.zero_()
        loss = F.cross_entropy(self.net.model(x), y)
        if not torch.isfinite(loss):
            raise WorkerError(f"training diverged at iteration {it}: loss is {loss.item()} "
                              "(lower --lr, or use --clip-norm)")
        loss.backward()
        t1 = time.perf_counter()

        k = self._k_at(it)
        if k != self.policy.k:
            self.policy.set_k(k)
        grad = self.net.grad_array(self.xp)
        host_grad = to_host(grad) if self.recorder else None  # read before the next backward
        grad_topk = topk_exact(host_grad, k) if self.recorder else None
        acc = self.memory.add(grad)  # error feedback: carry what was not sent
        group = None
        if self.policy.two_phase:
            proposal = self.policy.propose(acc, it)
            if proposal is None:
                proposal = self.xp.empty(0, dtype=self.xp.int64)
            check_output(self.policy, proposal, it, self.policy.max_propose, "propose")
            idx, vals = self.outbox.fetch(proposal, acc[proposal])
            self.stats["push_bytes"] += self._send(protocol.encode(
                "propose", idx.astype(self.index_dtype, copy=False), vals,
                model_size=self.net.numel, cache=self.cache, iter=it, rank=self.rank))
            msg = self._expect("indices", f"the group's indices of iteration {it}", it)
            self.stats["aggregate_bytes"] += msg.extra["nbytes"]
            group = msg.indices
        indices, values = self.outbox.fetch(*self._select(acc, it, group))
        if self.recorder:
            self.recorder.record(host_grad, grad_topk, indices)
        t2 = time.perf_counter()

        checksum = self.net.checksum() if it % self.cfg.check_every == 0 else None
        extra = {"checksum": checksum} if checksum else {}
        if protocol.dense_is_smaller(indices.size, self.net.numel, self.index_dtype.name):
            dense = self._dense_buffer()  # SparCML's switch: all values beat (index, value) pairs
            dense[:] = 0.0
            dense[indices] = values
            frames = protocol.encode("push", None, dense, iter=it, rank=self.rank, dense=True,
                                     loss=loss.item(), **extra)
        else:
            frames = protocol.encode("push", indices.astype(self.index_dtype, copy=False), values,
                                     model_size=self.net.numel, cache=self.cache, iter=it,
                                     rank=self.rank, loss=loss.item(), **extra)
        self.stats["push_bytes"] += self._send(frames)
        agg = self._expect("aggregate", f"the aggregate of iteration {it}", it)
        self.stats["aggregate_bytes"] += agg.extra["nbytes"]
        t3 = time.perf_counter()

        if "live" in agg.header and agg["live"] != self.live:
            self.live = sorted(agg["live"])  # an elastic run lost workers (docs/protocol.md)
            self.policy.set_live(self.live)
            self.log(f"live ranks now {self.live}; rank {self.evaluator} evaluates")
        if agg.get("dense"):
            self.policy.observe(*self._on_device(self._all_indices(), agg.values), it)
            self.net.set_grad(None, agg.values)
        else:
            self.policy.observe(*self._on_device(agg.indices, agg.values), it)
            self.net.set_grad(agg.indices, agg.values)
        if self.cfg.lr_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr_at(it / self.shard.batches_per_epoch)
        self.optimizer.step()
        self.stats["compute_s"] += t1 - t + time.perf_counter() - t3
        self.stats["select_s"] += t2 - t1
        self.stats["wait_s"] += t3 - t2

    def _select(self, acc, it: int, group):
        """The policy's indices and their accumulator values (zeroed there), on acc's device."""
        indices = self.policy.select(acc, it, group=None if group is None else
                                     self._on_device(group)[0])
        check_output(self.policy, indices, it, self.policy.max_push)  # before anything is sent
        return indices, self.memory.take(indices)

    def _on_device(self, *arrays):
        """Host arrays (a received message) moved to where the policy state lives, int64 indices."""
        return to_device(self.xp, *arrays)

    def _dense_buffer(self) -> np.ndarray:
        # Reused every round: the previous push has left once its aggregate came back.
        if getattr(self, "_dense", None) is None:
            self._dense = np.empty(self.net.numel, dtype=np.float32)
        return self._dense

    def _all_indices(self) -> np.ndarray:
        if getattr(self, "_arange", None) is None:
            self._arange = np.arange(self.net.numel, dtype=np.int64)
        return self._arange

    def evaluate(self, it: int) -> dict:
        test_loss, test_acc = evaluate_model(self.net.model, self.data, self.device)
        epoch = (it + 1) / self.shard.batches_per_epoch
        return {"epoch": round(epoch, 4), "test_loss": test_loss, "test_acc": test_acc}

    def report(self, it: int, values: dict, checksum: str | None = None) -> None:
        extra = {"checksum": checksum} if checksum else {}
        self._send(protocol.encode("metrics", iter=it, rank=self.rank, report=values, **extra))

    def finish(self, wall: float) -> None:
        info = {"rank": self.rank, "iterations": self.iterations, "numel": self.net.numel,
                "k": self.k, "checksum": self.net.checksum(), "wall_s": round(wall, 3),
                "policy": self.policy.describe(), "policy_state": self.policy.state_digest(),
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in self.stats.items()}}
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / f"rank-{self.rank}.json").write_text(json.dumps(info, indent=2))
        if self.recorder and self.out_dir:
            self.recorder.save(self.out_dir / f"selections-rank-{self.rank}.npz")
        if self.save_weights:
            torch.save(self.net.model.state_dict(), self.save_weights)
        self.log(f"done in {wall:.1f} s (checksum {info['checksum']})")

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.channel.close()


class HostBuffers:
    """Pinned host buffers the selected (index, value) pairs are copied into on the GPU path.

    Page-locked memory lets the device-to-host copy run at full PCIe speed; the buffers grow to
    the largest selection seen and are reused. Host arrays pass through untouched.
    """

    def __init__(self):
        self.indices = self.values = None

    def fetch(self, indices, values) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(indices, "get"):  # numpy: already on the host
            return indices, values
        n = int(indices.size)
        if self.indices is None or self.indices.size < n:
            size = max(n, 1024)
            self.indices = torch.empty(size, dtype=torch.int64, pin_memory=True).numpy()
            self.values = torch.empty(size, dtype=torch.float32, pin_memory=True).numpy()
        # Reuse is safe: a round's messages have reached the server (its reply came back)
        # before the next round fetches into the same buffers.
        return (to_host(indices.astype(self.indices.dtype, copy=False), self.indices[:n]),
                to_host(values, self.values[:n]))


def gpu_array_module(device: torch.device, log=print):
    """cupy when the worker runs on a CUDA device and CuPy is installed, else numpy."""
    if device.type != "cuda":
        return np
    cupy = cupy_or_none()
    if cupy is None:
        log("CuPy not found: selection runs on the host (one gradient copy per iteration; "
            f"{CUPY_HINT} for the GPU kernels)")
        return np
    cupy.cuda.Device(device.index or 0).use()
    return cupy


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, data, device: torch.device) -> tuple[float, float]:
    """(mean test loss, test accuracy) over the whole test set."""
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for x, y in test_batches(data):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        n += len(y)
    return loss_sum / n, correct / n


def local_rank(rank: int) -> int:
    """This process's index on its node: torchrun's LOCAL_RANK, SLURM_LOCALID, else the rank."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return rank


def pick_device(name: str, rank: int) -> torch.device:
    """cpu, or one GPU per worker: local rank modulo the visible devices (CUDA_VISIBLE_DEVICES
    is respected by CUDA itself); "auto" is cuda when a GPU is visible."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WorkerError("--device cuda, but no CUDA device is visible")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--connect must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


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
                   help="server address HOST:PORT (default: $PSPARSE_SERVER, else "
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
        args.rank = cluster.rank_from_env()
        if args.rank is None:
            p.error("--rank is required (or set RANK / SLURM_PROCID)")
    if args.workers is None and args.config is None:
        args.workers = cluster.world_size_from_env()
    try:
        cfg = resolve_config(args)
        host, port = parse_endpoint(args.connect or cluster.server_from_env() or
                                    "127.0.0.1:5555")
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    worker = None
    try:
        worker = Worker(cfg, args.rank, host, port, args.out, args.save_weights, args.resume,
                        run_token=args.run_token or os.environ.get("PSPARSE_TOKEN") or None)
        return worker.run()
    except (WorkerError, DataError, PolicyError) as exc:
        print(f"psparse-worker[{args.rank}]: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if worker is not None:
            worker.close()


if __name__ == "__main__":
    sys.exit(main())
