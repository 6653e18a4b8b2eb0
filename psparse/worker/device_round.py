"""A GPU worker's round steps: everything on the device, one synchronisation per message sent.

``DeviceEngine`` is the engine of ``psparse.worker.round.Round`` when the worker has a device
backend (``--device cuda`` with CuPy; ``PSPARSE_EMULATE_GPU`` on the CPU for the tests). One
round:

1. psparse's stream waits for torch's (the backward pass that wrote the flat gradient);
   the loss tensor is copied into a device slot (no ``.item()``); 2. the policy selects on the
   device (``psparse.backends.device_engines``): error feedback folded into the engine's first pass,
   the selected values gathered and zeroed in its last one; a policy that returns plain device
   indices gets a check kernel (range, order) and a take kernel;
3. **one copy back**: the selection's indices and values, its report (counts, non-finite
   entries), the check flags, the loss, and on checksum rounds the weights, into pinned host
   memory, then one wait: the round's only synchronisation (two-phase policies: one more, for
   the proposal);
4. the push and the aggregate (the host's business: ``psparse.worker.client``);
5. the aggregate goes up once, asynchronously from pinned memory; the policy observes it
   there, the gradient is zeroed and the aggregate scattered into it by one kernel (a dense
   one copied), and torch's stream waits for that before ``optimizer.step()``.

Nothing else reads a device value in a round; ``tests/test_device_round.py`` proves it with the
strict emulated backend, whose arrays refuse every other way to the host.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from ..backends.cuda import CaptureFailed
from ..backends.device_engines import DeviceSelection, Fusion
from .device_copy import SelectionCopy
from .divergence import read_loss
from .exchange import OnePhase, RoundContext, WholeModel
from .round import Part, Sent, carries_extras

GRAPH_UP_TO = 1 << 20  # models up to this many parameters capture their selection as a graph
EVERYTHING = object()  # a WholeModel round's choice: the whole accumulator, copied back


class DeviceEngine:
    """A round's steps on the device (see the module docstring); the round itself is
    ``psparse.worker.round.Round``."""

    def __init__(self, ctx: RoundContext, dev, shape):
        self.s, self.dev = ctx, dev  # s: the round context (psparse.worker.exchange)
        self.shape = shape  # exchange.OnePhase, TwoPhase or WholeModel
        xp = dev.xp
        net = ctx.net
        self.numel = net.numel
        self.grad = dev.from_torch(net.grad)  # the flat gradient, the same device memory
        self.params = dev.from_torch(net.params)
        self.selections = SelectionCopy(ctx, dev)  # a selection's one way to the host
        self.loss = xp.zeros(1, dtype=xp.float64)
        self.loss_torch = dev.to_torch(self.loss)
        # under a GradScaler: whether the unscaled gradient (or a part of it) is finite,
        # read with the round's one copy back; and the iteration whose memory is saved
        self.finite = xp.ones(1, dtype=xp.uint8)
        self._finite = ([], None)  # this round's (pairs for the copy back, host flag)
        self._saved_at = None
        self._fusion = None  # the error feedback the engine may fold in (this round's)
        self.all_indices = None  # every index, on the device (dense aggregates)
        # small models are launch-bound: a one-phase round's selection as one CUDA graph per
        # budget (PSPARSE_CUDA_GRAPH=1 / 0 forces it on / off)
        choice = os.environ.get("PSPARSE_CUDA_GRAPH", "")
        self.use_graphs = choice == "1" or (choice != "0" and dev.name == "cuda"
                                            and net.numel <= GRAPH_UP_TO)
        self.graphs: dict = {}  # (budget k, live ranks) -> (graph, its DeviceSelection)
        self._seen: set = set()  # those that ran once (their engines exist)
        self.graph_rounds = 0
        # the device's own time on the exchange (events on its stream): selection with its
        # fused error feedback, and applying the aggregate; read once they have passed
        self.device_ms = {"select": 0.0, "apply": 0.0}
        self._apply_marks = None
        self.received_idx = xp.zeros(1, dtype=xp.int64)
        self.received_val = xp.zeros(1, dtype=xp.float32)

    def scope(self):
        """psparse's stream: every device step of a round goes there."""
        return self.dev.stream_scope()

    def end_round(self) -> None:
        self.dev.end_round()

    # --------------------------------------------------------------------------- a round
    def take(self, it: int, part: Part | None, staged) -> Sent:
        """The round's (or part's) selection, error feedback fused, and one copy back with the
        loss, the weights on checksum rounds and a GradScaler's finiteness."""
        dev = self.dev
        dev.follow_torch()  # the backward pass that wrote the gradient
        start = dev.mark()
        self._finite = self._scale_in(it, part)  # under a GradScaler: unscaled, checked
        chosen = self._choose(it) if part is None else self._choose_part(it, part)
        sent = self._copy_back(it, part, chosen, staged)
        self._time_device("select", start, dev.copied)  # passed: the copy back waited
        return sent

    def stage_loss(self, it: int, loss) -> tuple[float | None, bool]:
        """(a host loss, whether the loss waits in the device slot): a loss tensor on the
        backend's device is copied into the slot on torch's stream, to come back with the
        round's copy; a host number, or a tensor elsewhere, is read as it is."""
        if isinstance(loss, torch.Tensor) and loss.device.type == self.dev.torch_device:
            self.loss_torch.copy_(loss.detach().reshape(-1)[:1].to(torch.float64))
            return None, True
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(-1)[0]
        return (None if loss is None else float(loss)), False

    def _scale_in(self, it: int, part: Part | None):
        """Under a GradScaler (psparse.worker.amp): the memory saved before the round's first
        device work, the gradient's keys (the part's) unscaled in place, and their finiteness
        staged for the round's copy back: ([(device flag, host flag)], host flag); without
        one, ([], None)."""
        scaling = self.s.scaling
        if scaling is None:
            return [], None
        if self._saved_at != it:
            scaling.save(self.s.memory)  # on psparse's stream: after the last round's work
            self._saved_at = it
        grad = self.grad if part is None else self.grad[part.lo:part.hi]
        grad *= np.float32(scaling.inv_scale)
        self.finite[0] = self.dev.xp.isfinite(grad).all()
        host = self.dev.pinned(f"finite-{0 if part is None else part.lo}", 1, np.uint8)
        return [(self.finite, host)], host

    def _choose(self, it: int):
        """A whole round's choice: the round shape's, error feedback fused into the engine
        where the policy lets it, or a captured graph replayed."""
        s, shape = self.s, self.shape
        policy, memory = s.policy, s.memory
        grad = memory.prepared(self.grad)
        if self.use_graphs and policy.graph_safe and memory.replayable and \
                isinstance(shape, OnePhase):
            # the first round at a budget runs launch by launch (it builds the engines);
            # the second captures the graph, which every later one replays
            budget = (policy.k, tuple(policy.live))  # core's split follows the live ranks
            entry = self.graphs.get(budget)
            if entry is None and budget in self._seen:
                entry = self._capture(it, budget)
            self._seen.add(budget)
            if entry is not None:
                graph, chosen = entry
                graph.launch()
                self.graph_rounds += 1
                return chosen
        fuse = policy.fuses_accumulation and not isinstance(shape, WholeModel)
        fusion = Fusion(memory.accumulate_spec(grad) if fuse else None,
                        memory.accumulator, memory.velocity)
        if fusion.accumulate is None:
            memory.add_prepared(grad)
        policy.fusion, self._fusion = fusion, fusion
        try:
            chosen = shape.choose(s, it, memory.accumulator, self)
        finally:
            policy.fusion, self._fusion = None, None
        if fusion.accumulate is not None:  # the policy never read the accumulator
            memory.add_prepared(grad)
        return chosen

    def _choose_part(self, it: int, part: Part):
        """A bucket's choice: the engine over its layers, its gradient folded in."""
        policy, memory = self.s.policy, self.s.memory
        fusion = Fusion(memory.accumulate_spec(memory.prepared(self.grad)),
                        memory.accumulator, memory.velocity)
        policy.engines.layers, policy.fusion = (part.first, part.end), fusion
        try:
            chosen = policy.select(memory.accumulator, it)
        finally:
            policy.engines.layers, policy.fusion = None, None
        if fusion.accumulate is not None:
            raise AssertionError(f"{type(policy).__name__} did not fold a bucket's gradient")
        return chosen

    def _capture(self, it: int, budget):
        """The round's selection (accumulation and take fused) captured as a graph for the
        current budget, or None (then graphs are off for this worker: said once)."""
        s, dev = self.s, self.dev
        policy, memory = s.policy, s.memory
        fusion = Fusion(memory.accumulate_spec(self.grad), memory.accumulator,
                        memory.velocity)
        box = {}

        def work():
            policy.fusion = fusion
            try:
                box["chosen"] = policy.select(memory.accumulator, it)
            finally:
                policy.fusion = None
        try:
            graph = dev.capture(work)
        except CaptureFailed as exc:
            why = str(exc)
        else:
            if fusion.accumulate is None and isinstance(box.get("chosen"), DeviceSelection):
                self.graphs[budget] = (graph, box["chosen"])
                return self.graphs[budget]
            why = "the selection is not the engine's alone"
        self.use_graphs = False
        s.say(f"no CUDA graph for {policy.describe()} ({why}): rounds run launch by launch")
        return None

    # the round shapes' steps (exchange.OnePhase, TwoPhase, WholeModel)
    def select(self, it: int, acc, group):
        if group is not None:
            group = self.dev.upload("group", np.asarray(group, dtype=np.int64))
        return self.s.policy.select(acc, it, group=group)

    def proposal(self, it: int, acc, proposal):
        """Phase 1 of a two-phase round: the proposal back on the host (a synchronisation,
        with a GradScaler's finiteness: an overflowing worker proposes nothing)."""
        s, dev, fusion = self.s, self.dev, self._fusion
        if fusion.accumulate is not None:  # no proposal read the accumulator: fold it now
            s.memory.add_prepared(fusion.accumulate[2])
            fusion.accumulate = None
        pairs, finite_host = self._finite
        idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        if proposal is not None:
            idx, val = self.selections.copy_back(it, proposal, s.policy.max_propose,
                                                 "propose", pairs)
        elif pairs:  # only the finiteness to read (a GradScaler's step)
            dev.copy_back(pairs)
        if self._overflowed(finite_host):
            idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        return idx.astype(np.int64, copy=False), val

    def everything(self, it: int, acc):
        return EVERYTHING

    def _copy_back(self, it: int, part: Part | None, chosen, staged) -> Sent:
        """The round's one copy back: the selection (or the whole accumulator), the loss, the
        weights on checksum rounds, a GradScaler's finiteness."""
        s, dev = self.s, self.dev
        host_loss, on_device = staged if staged is not None else (None, False)
        checksum_due = carries_extras(part) and s.checksum_due(it)
        extra = []
        if on_device:
            loss_host = dev.pinned("loss", 1, np.float64)
            extra.append((self.loss, loss_host))
        if checksum_due:
            weights = dev.pinned("weights", self.numel, np.float32)
            extra.append((self.params, weights))
        finite_pairs, finite_host = self._finite
        extra += finite_pairs
        if chosen is EVERYTHING:
            acc, memory = s.memory.accumulator, s.memory
            values = dev.pinned("whole", self.numel, np.float32)
            dev.copy_back([(acc, values)] + extra)
            acc.fill(0)
            if memory.velocity is not None:
                memory.velocity.fill(0)
            memory.after_take()
            indices = s.all_indices()
        else:
            indices, values = self.selections.copy_back(
                it, chosen, s.policy.max_push, "select", extra, 0 if part is None else part.index)
        loss, overflow = read_loss(float(loss_host[0]) if on_device else host_loss, it,
                                   s.scaling)
        overflow = overflow or self._overflowed(finite_host)
        checksum = hashlib.blake2b(weights.data, digest_size=8).hexdigest() \
            if checksum_due else None
        if overflow:  # nothing of a non-finite gradient is sent; every worker skips the step
            indices, values = np.empty(0, np.int64), np.empty(0, np.float32)
        return Sent(indices, values, loss, checksum, overflow)

    @staticmethod
    def _overflowed(finite_host) -> bool:
        return finite_host is not None and not finite_host[0]

    # -------------------------------------------------------------------------- aggregate
    def apply(self, agg, it: int) -> None:
        """The aggregate up (once), observed by the policy there, into the gradient; torch's
        stream waits for it."""
        s, dev, xp = self.s, self.dev, self.dev.xp
        if self._apply_marks is not None:  # the previous round's, passed by now
            self._time_device("apply", *self._apply_marks)
        begin = dev.mark()
        values = dev.upload("aggregate-values", np.asarray(agg.values, dtype=np.float32),
                            out=self._buffer("received_val", agg.values.size, xp.float32))
        if agg.get("dense"):
            if self.all_indices is None:
                self.all_indices = xp.arange(self.numel, dtype=xp.int64)
            s.policy.observe(self.all_indices, values, it)
            self.grad[...] = values
        else:
            indices = dev.upload("aggregate-indices",
                                 np.asarray(agg.indices).astype(np.int64, copy=False),
                                 out=self._buffer("received_idx", agg.indices.size, xp.int64))
            s.policy.observe(indices, values, it)
            self.grad.fill(0)
            if indices.size:
                dev.launch_over("psparse_scatter", indices.size, (
                    indices, values, np.int64(indices.size), self.grad))
        self._apply_marks = (begin, dev.mark())
        dev.lead_torch()

    def restore(self) -> None:
        """A skipped step: the memory as before it (on psparse's stream), torch's stream
        waiting for that."""
        self.s.scaling.restore(self.s.memory)
        self.dev.lead_torch()

    def _time_device(self, phase: str, start, stop) -> None:
        self.device_ms[phase] += self.dev.elapsed_ms(start, stop)

    def report(self, rounds: int) -> dict:
        """rank-R.json's ``device``: the backend's crossings, graph rounds, device time."""
        per = max(1, rounds)
        return {**self.dev.report(rounds), "graph_rounds": self.graph_rounds,
                "select_device_ms_per_iteration": round(self.device_ms["select"] / per, 4),
                "apply_device_ms_per_iteration": round(self.device_ms["apply"] / per, 4)}

    def _buffer(self, name: str, size: int, dtype):
        """A device buffer of at least ``size`` entries (grown, never shrunk), its first
        ``size``."""
        held = getattr(self, name)
        if held.size < size:
            held = self.dev.xp.zeros(max(size, 2 * held.size), dtype=dtype)
            setattr(self, name, held)
        return held[:size]
