"""The seam between a training loop and the parameter server: ``psparse.connect`` and ``Session``.

A user keeps their own loop and adds a handful of lines::

    ps = psparse.connect(model, optimizer, iterations=len(loader) * epochs)
    for x, y in loader:                       # for it in range(ps.start, ps.iterations): ...
        loss = loss_fn(model(x), y)
        loss.backward()
        ps.exchange(loss)                     # error feedback, selection, push, aggregate -> .grad
        optimizer.step()
        optimizer.zero_grad()
    ps.close()                                # final report; the server writes summary.json

``exchange`` folds the local gradient into the error-feedback accumulator, lets the selection
policy pick this round's entries, sends them to the server (``psparse.client``) and writes the
aggregate into every parameter's ``.grad``, so any ``torch.optim`` optimizer then applies the
same update on every replica. The built-in ``psparse-worker`` loop is a user of this class too.

What a round sends has three shapes (``OnePhase``, ``TwoPhase`` for policies with a proposal
phase, ``Dense`` when the budget is the whole model), one class each; the rest of a round is
the same for all.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from . import buckets, checkpoint, cluster, keyranges
from .backend import device_backend
from .client import PSClient, ServerGone, ShardedClient, WorkerError
from .config import DEFAULT_BUCKET_MB, ConfigError, RunConfig, config_from_json, load_config_file
from .device import FlatModel
from .device_round import DeviceRound
from .locality import SelectionRecorder
from .memory import SCALECOM_BETA, Memory, density_schedule
from .policies import Layout, PolicyError, SelectionPolicy, build_policy, check_output
from .rundir import EVAL_VALUES, rank_file
from .sparsify import NonFiniteError, density_to_k, topk_exact
from .xp import INDEX_DTYPE, to_device, to_host

__all__ = ["connect", "Session", "WorkerError", "ServerGone"]


# ------------------------------------------------------------------------------ round shapes
# A round shape decides what a round sends: ``choose(session, it, accumulator)`` returns the
# (indices, values) to push, taken out of the accumulator. It may use the session's ``policy``,
# ``memory``, ``client`` (for a proposal phase), ``outbox`` and ``select``; the rest of a round
# (accumulate before, push and apply after) is the same for every shape (``Session.exchange``).
class OnePhase:
    """The policy selects from the accumulator; those entries are pushed."""

    def choose(self, s: Session, it: int, acc):
        return s.select(acc, it, None)


class TwoPhase:
    """The policy proposes indices, the server keeps the group's choice, the policy selects
    with that choice in hand (``cltk``, ``vote``)."""

    def choose(self, s: Session, it: int, acc):
        proposal = s.policy.propose(acc, it)
        if proposal is None:
            proposal = np.empty(0, dtype=np.int64)
        check_output(s.policy, proposal, it, s.policy.max_propose, "propose")
        proposal = proposal.astype(INDEX_DTYPE, copy=False)
        group = s.client.propose(it, proposal, acc[proposal])
        return s.select(acc, it, np.asarray(group, dtype=INDEX_DTYPE))


class WholeModel:
    """The budget is the whole model (density 1): every entry is sent, no selection. (Not to
    be confused with a *dense push*, the encoding ``client.push`` picks when all values are
    smaller than (index, value) pairs.)"""

    def __init__(self):
        self.everything = None  # every index, made once (numel entries: not per round)

    def choose(self, s: Session, it: int, acc):
        if self.everything is None:
            self.everything = np.arange(acc.size, dtype=INDEX_DTYPE)
        return self.everything, s.memory.take(self.everything)


# ------------------------------------------------------------------------------------ parts
class Parts:
    """A round in buckets of layers (``bucket_mb``), optionally overlapped with backward
    (``overlap``): docs/api.md, Overlap; the wire side is docs/protocol.md, Parts.

    Buckets are contiguous groups of layers in reverse registration order (``psparse.buckets``),
    each a contiguous key range (a *part*). For each bucket, the session folds its gradient
    into the accumulator, lets the policy select per layer (``select_slice``, with each layer's
    k as in an ordinary ``--granularity layer`` round) and pushes the part. With ``overlap``,
    a ``register_post_accumulate_grad_hook`` on every parameter starts that work as soon as
    backward has produced a bucket's last gradient, so while backward computes the earlier
    layers the server already averages and returns the later ones (ZeroMQ's I/O thread sends
    and receives meanwhile). Part 0 (the first layers, ready last) is pushed by ``exchange``
    with the loss and the checksum; ``exchange`` then waits for every part's aggregate and
    applies the merged aggregate exactly as a one-part round does (the policy observes the
    whole aggregate once, in key order). Every selection, sum and update is the one of the
    ordinary round, so results are identical; only timing (and a few header bytes) differ.
    """

    def __init__(self, session: Session):
        s = self.session = session
        cfg = s.cfg
        policy = s.policy
        why = None
        if policy.two_phase:
            why = f"the two-phase policy {policy.name!r} (its proposal round needs every layer)"
        elif type(policy).select is not SelectionPolicy.select:
            why = (f"policy {type(policy).__name__}, which overrides select() (a bucket needs "
                   "per-layer selection: select_slice or score)")
        elif cfg.record_selections:
            why = "--record-selections (it records the whole gradient's top-k)"
        elif s.servers > 1:
            why = "several server shards (use one server)"
        elif policy.layout.granularity != "layer":
            why = "whole-model selection (use --granularity layer)"
        if why is not None:
            raise ConfigError(f"{'--overlap' if cfg.overlap else '--bucket-mb'} does not work "
                              f"with {why}; it keeps one round per iteration")
        sizes = s.net.layer_sizes
        self.buckets = buckets.plan(sizes, cfg.bucket_mb or DEFAULT_BUCKET_MB)
        self.edges = buckets.boundaries(sizes, self.buckets)
        self.offsets = [o for o, _ in policy.layout.slices]
        self.bucket_of = [b for b, (first, end) in enumerate(self.buckets)
                          for _ in range(first, end)]
        self.overlap = cfg.overlap
        s.client.use_parts(self.edges)
        self.hooks = []
        self.in_round = False
        self.ready = [0] * len(self.buckets)  # gradients produced this round, per bucket
        self.pushed: set[int] = set()
        self.trace: list[str] = []  # this round's events, in order (rank-R.json: last_round)
        self.last_trace: list[str] = []
        self.pushed_in_backward = 0
        if self.overlap:
            for layer, p in enumerate(s.net.parameters):
                self.hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, layer=layer: self.on_grad(layer)))

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def report(self) -> dict:
        """rank-R.json's ``overlap``: the buckets, how many pushes left during backward, and
        the order of events in the last round."""
        return {"enabled": self.overlap, "parts": self.edges,
                "layers": [list(b) for b in self.buckets],
                "pushes_in_backward": self.pushed_in_backward, "last_round": self.last_trace}

    # ------------------------------------------------------------------------------ a round
    def begin(self, it: int) -> None:
        """The round's start (its first bucket, or exchange): what ``exchange`` does first in a
        one-part round, before any gradient is folded in."""
        s = self.session
        s._check_iteration(it)
        if s.cfg.checkpoint_every and it > s.start and it % s.cfg.checkpoint_every == 0:
            s._checkpoint(it)  # the state after iteration it - 1's update, untouched yet
        self.t_begin = time.perf_counter()
        s._times["compute_s"] += self.t_begin - s._t_last
        k = s._k_at(it)
        if k != s.policy.k:
            s.policy.set_k(k)
        due = it % s.cfg.check_every == 0
        # the GPU path reads the weights back with part 0's copy (DeviceRound.push_part)
        self.checksum = s.net.checksum() if due and s.device_round is None else None
        self.checksum_due = due
        self.in_round = True
        self.ready = [0] * len(self.buckets)
        self.pushed = set()
        self.trace = []
        self.select_s = 0.0

    def on_grad(self, layer: int) -> None:
        """A parameter's gradient is complete (autograd hook, during backward)."""
        if not self.in_round:
            self.begin(self.session.iteration)
        b = self.bucket_of[layer]
        self.ready[b] += 1
        first, end = self.buckets[b]
        if self.ready[b] > end - first or b in self.pushed:
            raise WorkerError("with overlap, every exchange() follows exactly one backward "
                              "pass (a second backward before exchange() would change "
                              "gradients already sent; accumulate micro-batches without "
                              "overlap)")
        if self.ready[b] == end - first:
            self.trace.append(f"ready {b}")
            if b != 0:  # part 0 is ready last; exchange() sends it with the loss
                self.push(b)
                self.pushed_in_backward += 1

    def push(self, b: int, loss: float | None = None, checksum: str | None = None) -> None:
        """Fold bucket b's gradient in, select per layer, push part b."""
        s = self.session
        t0 = time.perf_counter()
        it = s.iteration
        first, end = self.buckets[b]
        lo, hi = self.edges[b], self.edges[b + 1]
        s.net.gather_layers(first, end)
        if s.device_round is not None:  # the engine over the bucket's layers, one copy back
            s.device_round.push_part(it, b, first, end, loss, b == 0 and self.checksum_due)
            self.pushed.add(b)
            self.trace.append(f"push {b}")
            self.select_s += time.perf_counter() - t0
            return
        acc = s.memory.add_range(s.net.grad_range(lo, hi), lo, hi)
        policy = s.policy
        chosen = []
        try:
            for layer in range(first, end):
                k, offset = policy.slice_k[layer], self.offsets[layer]
                if k > 0:
                    size = s.net.layer_sizes[layer]
                    chosen.append(policy.select_slice(acc[offset:offset + size], k, offset)
                                  + offset)
        except NonFiniteError as exc:
            raise WorkerError(f"training diverged at iteration {it}: {exc}") from None
        indices = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)
        check_output(policy, indices, it, policy.max_push)
        if indices.size and (int(indices[0]) < lo or int(indices[-1]) >= hi):
            raise PolicyError(f"policy {type(policy).__name__}.select_slice() at iteration "
                              f"{it} chose an index outside its layer")
        indices = indices.astype(INDEX_DTYPE, copy=False)
        values = s.memory.take(indices)
        s.client.send_part(it, b, indices, values, loss, checksum)
        self.pushed.add(b)
        self.trace.append(f"push {b}")
        self.select_s += time.perf_counter() - t0

    def exchange(self, it: int, loss: float | None) -> None:
        """After backward: push what the hooks did not (all buckets without overlap), last of
        all part 0 with the loss and checksum; wait for every part; apply."""
        s = self.session
        if not self.in_round:
            self.begin(it)
        self.trace.append("exchange")
        for b in range(len(self.buckets) - 1, 0, -1):
            if b not in self.pushed:
                self.push(b)
        self.push(0, loss, self.checksum)
        t2 = time.perf_counter()
        agg = s.client.await_parts(it)
        t3 = time.perf_counter()
        self.trace.append("aggregate")
        self.in_round = False
        self.last_trace = self.trace
        if s.device_round is not None:
            s.device_round.apply(agg, it)
        else:
            s._apply(agg, it)
        s._t_last = time.perf_counter()
        s._times["compute_s"] += (t2 - self.t_begin - self.select_s) + (s._t_last - t3)
        s._times["select_s"] += self.select_s
        s._times["wait_s"] += t3 - t2


# ---------------------------------------------------------------------------------- session
class Session:
    """One worker's side of a psparse run, for any training loop (see the module's docstring).

    Attributes a loop reads: ``rank``, ``world_size``, ``start`` (first iteration: > 0 after a
    resume), ``iterations``, ``iteration`` (the next exchange's), ``evaluator`` (the rank whose
    ``log`` values are recorded), ``k`` and ``stats`` (bytes and seconds so far).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 cfg: RunConfig, *, rank: int,
                 server: tuple[str, int] | list[tuple[str, int]], iterations: int,
                 batches_per_epoch: int | None = None, out_dir: str | Path | None = None,
                 run_token: str | None = None, resume: bool = False, device=None, say=None):
        if not 0 <= rank < cfg.workers:
            raise WorkerError(f"rank {rank} out of range [0, {cfg.workers})")
        self.cfg, self.rank, self.world_size = cfg, rank, cfg.workers
        self.iterations = iterations
        self.batches_per_epoch = batches_per_epoch
        if cfg.density_warmup and not batches_per_epoch:
            raise ConfigError("density_warmup needs the epoch length: connect(..., "
                              "batches_per_epoch=len(loader))")
        self.out_dir = Path(out_dir) if out_dir else None
        self._t_created = self._t_last = time.perf_counter()
        self._say = say  # where progress lines go (default: stderr)
        check_model(model)
        if device is None:  # where the trainable parameters are
            device = next(p for p in model.parameters() if p.requires_grad).device
        self.net = FlatModel(model, torch.device(device))
        self.device = self.net.device
        self.optimizer = optimizer
        # the GPU path: accumulator, selection and policy state on the device (CuPy kernels
        # through a backend, psparse.backend; None: the host path)
        self.dev = device_backend(self.device, self.say)
        self.xp = self.dev.xp if self.dev is not None else np
        self.memory = Memory(self.net.numel, cfg.memory, cfg.momentum, cfg.clip_norm,
                             beta=SCALECOM_BETA if cfg.memory_beta is None else cfg.memory_beta,
                             dev=self.dev)
        if optimizer is not None and not self.memory.optimizer_momentum_applies and not (
                isinstance(optimizer, torch.optim.SGD)
                and not any(g.get("momentum", 0) for g in optimizer.param_groups)):
            raise ConfigError("memory 'dgc' applies momentum in the accumulator: the optimizer "
                              "must be plain SGD (torch.optim.SGD with momentum=0), got "
                              f"{type(optimizer).__name__}")
        if cfg.checkpoint_every and (self.out_dir is None or optimizer is None):
            raise ConfigError("checkpoints (--checkpoint-every) need the run directory (out= or "
                              "PSPARSE_OUT) and the optimizer: connect(model, optimizer, ...)")
        self.k = density_to_k(cfg.density, self.net.numel)
        self.policy = build_policy(cfg.policy, cfg.policy_args,
                                   Layout(self.net.layer_sizes, cfg.granularity),
                                   self._k_at(0), rank=rank, world_size=cfg.workers,
                                   seed=cfg.seed, dev=self.dev)
        if cfg.record_selections and self.dev is not None:
            raise ConfigError("--record-selections reads the whole gradient and accumulator "
                              "back every round: it runs on the host path (--device cpu, or "
                              "without CuPy)")
        self.recorder = SelectionRecorder(self.net.layer_sizes, self.net.layer_names) \
            if cfg.record_selections else None
        self.live = list(range(cfg.workers))  # ranks still in the run (elastic runs lose some)
        # one server, or S key-range shards (a list of addresses, in shard order)
        servers = server if isinstance(server, list) else [server]
        self.servers = len(servers)
        if cfg.servers > 1 and self.servers != cfg.servers:
            raise ConfigError(f"the run has {cfg.servers} server shards (--servers) but this "
                              f"worker was given {self.servers} server address(es): give "
                              "every shard's HOST:PORT, comma-separated, in shard order")
        client_options = dict(timeout=cfg.timeout,
                              max_message_bytes=int(cfg.max_message_mb * 1e6),
                              curve_keys=cfg.curve_keys, run_token=run_token)
        if self.servers > 1:
            try:
                keyranges.check_shardable(cfg)
                self.client = ShardedClient(servers, rank, cfg.workers, numel=self.net.numel,
                                            **client_options)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        else:
            self.client = PSClient(servers[0][0], servers[0][1], rank, cfg.workers,
                                   numel=self.net.numel, **client_options)
        self._times = {"compute_s": 0.0, "select_s": 0.0, "wait_s": 0.0}
        self.start = self.iteration = 0
        self.last_report: tuple[int, dict] | None = None  # the evaluator's latest, for resume
        self._dense = self._arange = None
        self._buffers_at_checkpoint = None  # model buffers as they were after the update
        self.closed = False
        self.parts: Parts | None = None  # --bucket-mb / --overlap: the round in buckets
        try:
            if cfg.overlap or cfg.bucket_mb is not None:
                self.parts = Parts(self)
            if resume:
                self._restore()
            self.steps = self.budget_steps()
        except BaseException:
            self.client.close()  # not registered yet: nobody to tell, just leave
            raise
        whole = all(step[1] == self.net.numel for step in self.steps)
        # a two-phase policy keeps its proposal phase even at density 1: the run says two_phase
        self.round = TwoPhase() if self.policy.two_phase else WholeModel() if whole \
            else OnePhase()
        self.device_round = DeviceRound(self, self.dev, isinstance(self.round, WholeModel)) \
            if self.dev is not None else None

    # ----------------------------------------------------------------------------- basics
    def log(self, **values) -> None:
        """Evaluation results of the iteration just exchanged (``test_acc=``, ``test_loss=``,
        ``train_loss=``, ``epoch=``) into the run's eval.jsonl. Only the evaluator's are
        recorded (on other ranks this returns at once), so every rank may call it."""
        _check_eval_values(values)
        if not self.is_evaluator:
            return  # only the evaluator's results are the run's (the server ignores others')
        values = {k: float(v) for k, v in values.items()}
        if "epoch" not in values and self.batches_per_epoch:
            values = {"epoch": round(self.iteration / self.batches_per_epoch, 4), **values}
        self.last_report = (self.iteration - 1, values)
        self.client.report(*self.last_report)

    def say(self, text: str) -> None:
        """A progress line on stderr, prefixed with the rank and the time since connect."""
        if self._say is not None:
            self._say(text)
        else:
            print(f"[rank {self.rank} +{time.perf_counter() - self._t_created:.1f}s] {text}",
                  file=sys.stderr, flush=True)

    @property
    def evaluator(self) -> int:
        """The rank that evaluates: rank 0, or the lowest live rank once rank 0 was lost."""
        return min(self.live)

    @property
    def is_evaluator(self) -> bool:
        return self.rank == self.evaluator

    @property
    def stats(self) -> dict:
        return {"push_bytes": self.client.sent_bytes, "aggregate_bytes":
                self.client.received_bytes, **self._times}

    def on_device(self, *arrays):
        """A received message's arrays as the host policy takes them (int64 indices)."""
        return to_device(np, *arrays)

    def _k_at(self, it: int) -> int:
        """Entries to send at iteration ``it`` (the density warm-up lowers it epoch by epoch)."""
        if not self.cfg.density_warmup:
            return self.k
        epoch = it / self.batches_per_epoch
        density = density_schedule(self.cfg.density, self.cfg.density_warmup, epoch)
        return density_to_k(density, self.net.numel)

    # ------------------------------------------------------------------------- registration
    def register(self) -> None:
        """Join the run: every worker registered and agreed (the server checks) or an error."""
        self.client.register(self.describe_run(), self.net.checksum(), self.start)
        self.say(f"registered: numel={self.net.numel} k={self.k} iterations={self.iterations} "
                 f"policy={self.policy.describe()} memory={self.cfg.memory}"
                 + (f"(beta={self.memory.beta})" if self.cfg.memory == "scalecom" else ""))
        if self.last_report is not None and self.last_report[0] == self.start - 1:
            self.client.report(*self.last_report)  # the server may not have written it
        self._t_last = time.perf_counter()

    def describe_run(self) -> dict:
        """The run description every rank must agree on (docs/protocol.md, "The run"): model
        size, length, round kind, the budget steps (the server enforces them) and the shared
        options, with the model's parameter shapes."""
        config = {**self.cfg.agreed(), "layers": [
            f"{name}:{'x'.join(map(str, shape))}"
            for name, shape in zip(self.net.layer_names, self.net.layer_shapes)]}
        run = {"numel": self.net.numel, "iterations": self.iterations,
               "two_phase": self.policy.two_phase, "steps": self.steps, "config": config}
        if self.parts is not None:
            run["parts"] = self.parts.edges
        return run

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

    # --------------------------------------------------------------------------------- round
    def exchange(self, loss=None) -> None:
        """One synchronous round: this worker's gradient in, everyone's aggregate out.

        Reads the parameters' ``.grad`` (after ``loss.backward()``), adds it to the
        error-feedback accumulator, sends the policy's selection, and writes the aggregate
        (the mean over workers) into every parameter's ``.grad``, ready for
        ``optimizer.step()``. ``loss`` (a tensor or a float) is averaged into metrics.jsonl.
        """
        it = self.iteration
        self._check_iteration(it)
        if self.device_round is not None:  # the loss is read back with the round's copy
            if self.parts is not None:
                return self.parts.exchange(it, loss)
            if self.cfg.checkpoint_every and it > self.start and \
                    it % self.cfg.checkpoint_every == 0:
                self._checkpoint(it)
            return self.device_round.exchange(it, loss)
        if loss is not None:
            loss = float(loss.item() if hasattr(loss, "item") else loss)
            if not math.isfinite(loss):
                raise WorkerError(f"training diverged at iteration {it}: loss is {loss} "
                                  "(lower the learning rate, or use clip_norm)")
        if self.parts is not None:
            return self.parts.exchange(it, loss)
        if self.cfg.checkpoint_every and it > self.start and it % self.cfg.checkpoint_every == 0:
            self._checkpoint(it)  # the state after iteration it - 1's update
        t1 = time.perf_counter()  # compute_s: everything since the last exchange returned
        self._times["compute_s"] += t1 - self._t_last
        k = self._k_at(it)
        if k != self.policy.k:
            self.policy.set_k(k)
        self.net.gather_grad()
        grad = self.net.grad_array()
        host_grad = to_host(grad) if self.recorder else None  # read before the next backward
        grad_topk = topk_exact(host_grad, k) if self.recorder else None
        acc = self.memory.add(grad)  # error feedback: carry what was not sent
        # the push empties the sent entries: keep what the policy chose from
        host_acc = to_host(acc).copy() if self.recorder else None
        try:
            indices, values = self.round.choose(self, it, acc)
        except NonFiniteError as exc:  # selection refuses an accumulator with NaN or inf
            raise WorkerError(f"training diverged at iteration {it}: {exc}") from None
        if self.recorder:
            self.recorder.record(host_grad, grad_topk, to_host(indices), host_acc)
        t2 = time.perf_counter()

        checksum = self.net.checksum() if it % self.cfg.check_every == 0 else None
        agg = self.client.push(it, indices, values, loss, checksum, self._dense_buffer())
        t3 = time.perf_counter()
        self._apply(agg, it)
        self._t_last = time.perf_counter()
        self._times["compute_s"] += self._t_last - t3
        self._times["select_s"] += t2 - t1
        self._times["wait_s"] += t3 - t2

    def _check_iteration(self, it: int) -> None:
        if it >= self.iterations:
            raise WorkerError(f"exchange() after the run's last iteration ({self.iterations} "
                              "iterations agreed at connect)")

    def _apply(self, agg, it: int) -> None:
        """The round's aggregate: the policy observes it, it lands in .grad; the iteration
        is done."""
        self._note_live(agg)
        if agg.get("dense"):
            self.policy.observe(*self.on_device(self._all_indices(), agg.values), it)
            self.net.set_grad(None, agg.values)
        else:
            self.policy.observe(*self.on_device(agg.indices, agg.values), it)
            self.net.set_grad(agg.indices, agg.values)
        self._finish_iteration(it)

    def _note_live(self, agg) -> None:
        if "live" in agg.header and agg["live"] != self.live:
            self.live = sorted(agg["live"])  # an elastic run lost workers (docs/protocol.md)
            self.policy.set_live(self.live)
            self.say(f"live ranks now {self.live}; rank {self.evaluator} evaluates")

    def _finish_iteration(self, it: int) -> None:
        """Iteration ``it`` is applied: the next one's number, and the buffers a checkpoint of
        the next iteration must keep."""
        self.iteration = it + 1
        if self.cfg.checkpoint_every and self.iteration % self.cfg.checkpoint_every == 0:
            # The checkpoint of iteration it + 1 is written at the next exchange, once the
            # optimizer has stepped; by then the next forward pass has moved buffers such as
            # BatchNorm's running statistics, so keep them as they are now.
            self._buffers_at_checkpoint = {name: b.detach().clone()
                                           for name, b in self.net.model.named_buffers()}

    def select(self, acc, it: int, group):
        """The policy's indices and their accumulator values (zeroed there), on acc's device."""
        indices = self.policy.select(acc, it, group=group)
        check_output(self.policy, indices, it, self.policy.max_push)  # before anything is sent
        indices = indices.astype(INDEX_DTYPE, copy=False)  # the kernels take int64 (xp.py)
        return indices, self.memory.take(indices)

    def _dense_buffer(self) -> np.ndarray:
        # Reused every round: the previous push has left once its aggregate came back.
        if self._dense is None:
            self._dense = np.empty(self.net.numel, dtype=np.float32)
        return self._dense

    def _all_indices(self) -> np.ndarray:
        if self._arange is None:
            self._arange = np.arange(self.net.numel, dtype=np.int64)
        return self._arange

    # -------------------------------------------------------------------------------- ending
    def close(self, **final) -> None:
        """End of training: the final report (with the evaluator's ``final`` values, e.g.
        ``close(test_acc=...)``, and the weight checksum), the server's shutdown, then this
        rank's rank-R.json. The server writes summary.json."""
        if self.iteration < self.iterations:
            raise WorkerError(f"close() after {self.iteration} of {self.iterations} iterations "
                              "(the run's length was agreed at connect)")
        _check_eval_values(final)
        wall = time.perf_counter() - self._t_created
        # the rounds' device crossings, before the reads of the final report below
        device = self.device_round.report(self.iterations - self.start) \
            if self.device_round is not None else None
        values = {k: float(v) for k, v in final.items()} if self.is_evaluator else {}
        self.client.finish(self.iterations - 1, values, self.net.checksum())
        info = {"rank": self.rank, "iterations": self.iterations, "numel": self.net.numel,
                "k": self.k, "checksum": self.net.checksum(), "wall_s": round(wall, 3),
                "policy": self.policy.describe(), "policy_state": self.policy.state_digest(),
                "options": self.cfg.agreed(),
                **({"overlap": self.parts.report()} if self.parts is not None else {}),
                **({"device": device} if device is not None else {}),
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in self.stats.items()}}
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / rank_file(self.rank)).write_text(json.dumps(info, indent=2))
            if self.recorder:
                self.recorder.save(self.out_dir / f"selections-rank-{self.rank}.npz")
        self.say(f"done in {wall:.1f} s (checksum {info['checksum']})")
        self.disconnect()

    def fail(self, exc: BaseException) -> None:
        """Report why this worker stops (summary.json names the cause), then disconnect."""
        if not isinstance(exc, ServerGone):
            cause = str(exc) if isinstance(exc, (WorkerError, PolicyError, ConfigError)) \
                else f"{type(exc).__name__}: {exc}"
            self.client.give_up(cause)
        self.disconnect()

    def disconnect(self) -> None:
        if not self.closed:
            self.closed = True
            if self.parts is not None:
                self.parts.remove_hooks()
            self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``with psparse.connect(...) as ps:`` -- an exception is reported to the server (its
        cause reaches summary.json); a complete run not closed yet is closed."""
        if self.closed:
            return
        if exc is not None:
            self.fail(exc)
        elif self.iteration < self.iterations:
            early = WorkerError(f"left the run after {self.iteration} of {self.iterations} "
                                "iterations")
            self.fail(early)
            raise early
        else:
            self.close()

    # ---------------------------------------------------------------------- checkpoint, resume
    def state_dict(self) -> dict:
        """Everything of this worker's exchange state a resume needs: model, optimizer,
        accumulator, policy state, key cache, byte and time totals, the last evaluation."""
        # clones: the parameters are views of one flat buffer, and pickling a view writes the
        # whole buffer once per parameter
        model = {name: t.detach().clone() for name, t in self.net.model.state_dict().items()}
        return {
            "iteration": self.iteration,
            "model": model,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "memory": {name: self.policy.host(a) for name, a in self.memory.state_dict().items()},
            "policy": {name: self.policy.host(v) if hasattr(v, "shape") else v
                       for name, v in self.policy.state_dict().items()},
            "cache": self.client.cache_state(),
            "stats": self.stats,
            "last_report": self.last_report,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():  # copies into the flat buffers the parameters view
            self.net.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for name, array in state["memory"].items():
            if self.dev is not None:
                self.dev.upload(f"restore-{name}", np.asarray(array), out=getattr(self.memory, name))
            else:
                getattr(self.memory, name)[...] = np.asarray(array)
        self.policy.load_state_dict(state["policy"])
        self.client.restore_cache(state["cache"])
        stats = state["stats"]
        self.client.sent_bytes = stats["push_bytes"]
        self.client.received_bytes = stats["aggregate_bytes"]
        self._times.update({k: stats[k] for k in self._times})
        self.last_report = state["last_report"]
        self.start = self.iteration = state["iteration"]

    def _checkpoint(self, iteration: int) -> None:
        state = self.state_dict()
        if self._buffers_at_checkpoint is not None:
            state["model"].update(self._buffers_at_checkpoint)
            self._buffers_at_checkpoint = None
        checkpoint.save(self.out_dir, f"rank-{self.rank}", iteration, {**state,
                                                                     "iteration": iteration})

    def _restore(self) -> None:
        if not self.out_dir:
            raise WorkerError("resume needs the run directory (--out)")
        start = checkpoint.latest_common(self.out_dir, self.cfg.workers, self.servers)
        if start is None:
            raise WorkerError(f"no checkpoint in {self.out_dir} that the server and all "
                              f"{self.cfg.workers} workers saved")
        self.load_state_dict(checkpoint.load(self.out_dir, f"rank-{self.rank}", start))
        self.say(f"resuming at iteration {start}")


def _check_eval_values(values: dict) -> None:
    unknown = sorted(set(values) - set(EVAL_VALUES))
    if unknown:
        raise ValueError(f"unknown evaluation value {', '.join(unknown)}; eval.jsonl records "
                         f"{', '.join(EVAL_VALUES)}")


def check_model(model: torch.nn.Module) -> None:
    """Trainable parameters must be float32 and on one device (clear errors otherwise)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    bad = [f"{n} ({p.dtype})" for n, p in params if p.dtype != torch.float32]
    if bad:
        raise ConfigError("psparse exchanges float32 parameters; convert the model with "
                          f".float() (not float32: {', '.join(bad[:5])}"
                          f"{', ...' if len(bad) > 5 else ''})")
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices ({devices}); "
                          "psparse needs them on one")


# ------------------------------------------------------------------------------- connect()
def connect(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
            iterations: int | None = None, batches_per_epoch: int | None = None,
            server: str | None = None, rank: int | None = None, world_size: int | None = None,
            out: str | Path | None = None, run_token: str | None = None,
            resume: bool | None = None, **options) -> Session:
    """Join a psparse run with ``model``: register with the server and return the Session.

    Where things come from (first found wins):

    - ``rank`` / ``world_size``: the arguments, else ``RANK`` / ``WORLD_SIZE`` (psparse-launch,
      torchrun, SLURM, PMI and Open MPI variables);
    - ``server`` ("host:port"): the argument, else ``PSPARSE_SERVER``, else
      ``MASTER_ADDR``:``PSPARSE_PORT``;
    - options (``policy``, ``density``, ``granularity``, ``memory``, ``policy_args``,
      ``clip_norm``, ``density_warmup``, ``check_every``, ``checkpoint_every``, ``timeout``,
      ``curve_keys``, ...; the fields of README's run configuration): keyword arguments, else
      the launcher's run configuration (``PSPARSE_CONFIG``, its config.json), else defaults;
    - ``iterations``: the argument, else the configuration's ``iterations``, else its
      ``epochs`` × ``batches_per_epoch``;
    - ``out`` (the run directory, for rank-R.json and checkpoints): the argument, else
      ``PSPARSE_OUT``; ``run_token``: the argument, else ``PSPARSE_TOKEN``; ``resume``: the
      argument, else ``PSPARSE_RESUME=1`` (psparse-launch --resume).

    Every rank must call it with the same model architecture and options (the server compares
    them and names the first difference). The initial weights must match too: seed torch the
    same on every rank before building the model, or load the same weights.
    """
    cfg = _resolve_options(options, world_size)
    if rank is None:
        rank = cluster.rank_from_env()
        if rank is None:
            raise ConfigError("psparse.connect: no rank (pass rank=..., or run under "
                              "psparse-launch / torchrun, which set RANK)")
    if iterations is None:
        if cfg.iterations is not None:
            iterations = cfg.iterations
        elif batches_per_epoch:
            iterations = math.ceil(cfg.epochs * batches_per_epoch)
        else:
            raise ConfigError("psparse.connect: the run's length is needed: iterations=N "
                              "(or batches_per_epoch=len(loader) with the epochs option, or "
                              "psparse-launch --iterations/--epochs)")
    address = server or cluster.server_from_env() or "127.0.0.1:5555"
    try:
        servers = cluster.parse_servers(address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if out is None and os.environ.get("PSPARSE_OUT"):
        out = os.environ["PSPARSE_OUT"]
    if resume is None:
        resume = os.environ.get("PSPARSE_RESUME") == "1"
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    session = Session(model, optimizer, cfg, rank=rank,
                      server=servers if len(servers) > 1 else servers[0],
                      iterations=iterations, batches_per_epoch=batches_per_epoch, out_dir=out,
                      run_token=run_token or os.environ.get("PSPARSE_TOKEN") or None,
                      resume=resume)
    try:
        session.register()
    except BaseException as exc:
        session.fail(exc)
        raise
    return session


# options the server acts on too (checkpoints at the same iterations, the broadcast limit, ...):
# they come from the launcher's configuration, never from one worker's connect()
SERVER_OPTIONS = ("checkpoint_every", "server_limit", "server_device", "bandwidth", "elastic",
                  "register_timeout", "workers", "servers")


def _resolve_options(options: dict, world_size: int | None) -> RunConfig:
    """Defaults, then the launcher's config.json (PSPARSE_CONFIG), then keyword options."""
    values = {}
    launched = os.environ.get("PSPARSE_CONFIG") or os.environ.get("PSPARSE_CONFIG_JSON")
    if os.environ.get("PSPARSE_CONFIG"):  # the launcher's config.json (same host)
        values.update(load_config_file(Path(os.environ["PSPARSE_CONFIG"])))
    elif os.environ.get("PSPARSE_CONFIG_JSON"):  # the same, inline (cluster modes)
        values.update(config_from_json(os.environ["PSPARSE_CONFIG_JSON"], "PSPARSE_CONFIG_JSON"))
    known = {f.name for f in fields(RunConfig)}
    shared = sorted(set(options) & set(SERVER_OPTIONS))
    if shared:
        raise ConfigError(f"psparse.connect: {', '.join(shared)} must match the server's: set "
                          "it on psparse-launch (or psparse-server), not in connect()")
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"psparse.connect: unknown option {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(known - set(SERVER_OPTIONS)))}")
    if isinstance(options.get("policy_args"), dict):
        options["policy_args"] = [f"{k}={v}" for k, v in options["policy_args"].items()]
    values.update(options)
    if world_size is not None:
        values["workers"] = world_size
    elif not launched:
        env_world = cluster.world_size_from_env()
        if env_world is None:
            raise ConfigError("psparse.connect: no world size (pass world_size=..., or run "
                              "under psparse-launch / torchrun, which set WORLD_SIZE)")
        values["workers"] = env_world
    return replace(RunConfig(), **values).validate()
