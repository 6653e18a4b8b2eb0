"""A GPU worker's round: everything on the device, one synchronisation per message it sends.

``Session.exchange`` hands a round to ``DeviceRound`` when the worker has a device backend
(``--device cuda`` with CuPy; ``PSPARSE_EMULATE_GPU`` on the CPU for the tests). One round:

1. psparse's stream waits for torch's (the backward pass that wrote the flat gradient);
   the loss tensor is copied into a device slot (no ``.item()``);
2. the policy selects on the device (``psparse.gpu.device_policy``): error feedback folded into the
   engine's first pass, the selected values gathered and zeroed in its last one; a policy
   that returns plain device indices gets a check kernel (range, order) and a take kernel;
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
import time

import numpy as np
import torch

from ..gpu.backend import CaptureFailed
from ..gpu.device_policy import DeviceSelection, Fusion
from .device_copy import SelectionCopy
from .divergence import read_loss, require_scaler
from .exchange import RoundContext

GRAPH_UP_TO = 1 << 20  # models up to this many parameters capture their selection as a graph


class DeviceRound:
    """The device side of one worker's rounds (see the module docstring)."""

    def __init__(self, ctx: RoundContext, dev, whole: bool):
        self.s, self.dev = ctx, dev  # s: the round context (psparse.worker.exchange)
        self.whole = whole  # the budget is the whole model: no selection (a dense round)
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

    # --------------------------------------------------------------------------- a round
    def exchange(self, it: int, loss) -> None:
        s, dev = self.s, self.dev
        t1 = s.clock.begin()
        s.net.gather_grad()  # torch's stream: gradients that are not views of the flat buffer
        host_loss, staged = self._stage_loss(loss)  # torch's stream too: before the event
        with dev.stream_scope():
            dev.follow_torch()
            start = dev.mark()
            indices, values, host_loss, checksum, overflow = self._choose(it, host_loss,
                                                                          staged)
            self._time_device("select", start, dev.copied)  # passed: the copy back waited
            if self._apply_marks is not None:  # the previous round's, passed by now
                self._time_device("apply", *self._apply_marks)
            t2 = time.perf_counter()
            agg = s.client.push(it, indices, values, host_loss, checksum, s.dense_buffer(),
                                overflow=overflow)
            t3 = time.perf_counter()
            begin = dev.mark()
            skipped = agg.get("overflow")
            if skipped:  # some worker overflowed (a GradScaler's step): every one skips
                require_scaler(s, it)
                s.scaling.restore(s.memory)
            else:
                self._apply(agg, it)
            self._apply_marks = (begin, dev.mark())
            dev.lead_torch()
        self._after(agg, it, skipped)
        dev.end_round()
        s.clock.add("select_s", t2 - t1)
        s.clock.add("wait_s", t3 - t2)
        s.clock.end(t3)

    def push_part(self, it: int, part: int, first: int, end: int, loss,
                  checksum_due: bool, bounds: tuple[int, int],
                  loss_overflowed: bool = False) -> None:
        """One bucket of a round in parts (``--bucket-mb`` / ``--overlap``): the engine over
        layers [first, end) (keys ``bounds``), error feedback fused as in a whole round, one
        copy back, the part sent. Part 0 (pushed last, by exchange) carries the loss and the
        checksum. Under a GradScaler the part is unscaled first and its finiteness comes back
        with the copy: a part that overflowed goes empty, with the flag."""
        s, dev = self.s, self.dev
        policy, memory = s.policy, s.memory
        host_loss, staged = self._stage_loss(loss) if part == 0 else (None, False)
        with dev.stream_scope():
            dev.follow_torch()
            start = dev.mark()
            finite_pairs, finite_host = self._scale_in(it, *bounds)
            fusion = Fusion(memory.accumulate_spec(memory.clipped(self.grad)),
                            memory.accumulator, memory.velocity)
            policy.engines.layers, policy.fusion = (first, end), fusion
            try:
                chosen = policy.select(memory.accumulator, it)
            finally:
                policy.engines.layers, policy.fusion = None, None
            if fusion.accumulate is not None:
                raise AssertionError(f"{type(policy).__name__} did not fold a bucket's gradient")
            extra, loss_host, weights = self._extras(staged, checksum_due)
            indices, values = self.selections.copy_back(it, chosen, policy.max_push, "select",
                                                        extra + finite_pairs, part)
            self._time_device("select", start, dev.copied)
        host_loss, overflow = self._read_loss(it, host_loss, staged, loss_host)
        overflow = overflow or loss_overflowed or self._overflowed(finite_host)
        checksum = hashlib.blake2b(weights.data, digest_size=8).hexdigest() \
            if checksum_due else None
        if overflow:  # nothing of this part's gradient is sent (its memory is restored)
            indices, values = np.empty(0, np.int64), np.empty(0, np.float32)
        s.client.send_part(it, part, indices, values, host_loss, checksum, overflow=overflow)

    def _extras(self, staged: bool, checksum_due: bool):
        """The pairs a round's copy back adds: the loss slot, the weights on checksum rounds."""
        dev = self.dev
        extra, loss_host, weights = [], None, None
        if staged:
            loss_host = dev.pinned("loss", 1, np.float64)
            extra.append((self.loss, loss_host))
        if checksum_due:
            weights = dev.pinned("weights", self.numel, np.float32)
            extra.append((self.params, weights))
        return extra, loss_host, weights

    def _read_loss(self, it: int, host_loss, staged: bool, loss_host):
        """(the loss as read back, whether it overflowed): not finite is an overflow under a
        GradScaler (the step is skipped), else a diverged run."""
        return read_loss(float(loss_host[0]) if staged else host_loss, it, self.s.scaling)

    def _scale_in(self, it: int, lo: int = 0, hi: int | None = None):
        """Under a GradScaler (psparse.worker.amp): the memory saved before the round's first
        device work, the gradient's keys [lo, hi) unscaled in place, and their finiteness
        staged for the round's copy back: ([(device flag, host flag)], host flag); without
        one, ([], None)."""
        scaling = self.s.scaling
        if scaling is None:
            return [], None
        if self._saved_at != it:
            scaling.save(self.s.memory)  # on psparse's stream: after the last round's work
            self._saved_at = it
        grad = self.grad if lo == 0 and hi in (None, self.numel) else self.grad[lo:hi]
        grad *= np.float32(scaling.inv_scale)
        self.finite[0] = self.dev.xp.isfinite(grad).all()
        host = self.dev.pinned(f"finite-{lo}", 1, np.uint8)
        return [(self.finite, host)], host

    @staticmethod
    def _overflowed(finite_host) -> bool:
        return finite_host is not None and not finite_host[0]

    def _after(self, agg, it: int, skipped: bool) -> None:
        """On torch's stream, after the round: a skipped step's ``.grad`` is inf (so that
        ``scaler.step`` skips), an applied one's is × S for ``scaler.step``'s unscale."""
        s = self.s
        if skipped:
            s.scaling.poison(s.net)
            s.note_live(agg)
            s.applied(it)
        elif s.scaling is not None:
            s.scaling.rescale(s.net)

    def skip(self, agg, it: int) -> None:
        """A round in parts that the server flagged (some part overflowed somewhere): the
        memory as before the step, ``.grad`` inf, nothing observed."""
        require_scaler(self.s, it)
        with self.dev.stream_scope():
            self.s.scaling.restore(self.s.memory)
            self.dev.lead_torch()
        self._after(agg, it, True)
        self.dev.end_round()

    def _time_device(self, phase: str, start, stop) -> None:
        self.device_ms[phase] += self.dev.elapsed_ms(start, stop)

    def report(self, rounds: int) -> dict:
        """rank-R.json's ``device``: the backend's crossings, graph rounds, device time."""
        per = max(1, rounds)
        return {**self.dev.report(rounds), "graph_rounds": self.graph_rounds,
                "select_device_ms_per_iteration": round(self.device_ms["select"] / per, 4),
                "apply_device_ms_per_iteration": round(self.device_ms["apply"] / per, 4)}

    def _stage_loss(self, loss) -> tuple[float | None, bool]:
        """A loss tensor on the backend's device is copied into the device slot on torch's
        stream (call it before ``follow_torch``), to come back with the round's copy (True); a
        host number, or a tensor elsewhere, is read as it is."""
        if isinstance(loss, torch.Tensor) and loss.device.type == self.dev.torch_device:
            self.loss_torch.copy_(loss.detach().reshape(-1)[:1].to(torch.float64))
            return None, True
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(-1)[0]
        return (None if loss is None else float(loss)), False

    def _choose(self, it: int, host_loss, staged: bool):
        """This round's (indices, values) on the host, the loss, and the checksum (if due)."""
        s = self.s
        policy, memory = s.policy, s.memory
        s.set_budget(it)
        self._finite = self._scale_in(it)  # under a GradScaler: unscaled, checked
        grad = memory.clipped(self.grad)
        if self.whole:
            acc = memory.add_clipped(grad)
            return self._finish(it, None, acc, host_loss, staged, whole=True)
        if self.use_graphs and policy.graph_safe and memory.clip_norm is None:
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
                return self._finish(it, chosen, None, host_loss, staged)
        fusion = Fusion(memory.accumulate_spec(grad) if policy.fuses_accumulation else None,
                        memory.accumulator, memory.velocity)
        if fusion.accumulate is None:
            memory.add_clipped(grad)
        policy.fusion = fusion
        try:
            group = None
            if policy.two_phase:
                group = self._proposal_round(it, fusion)
            chosen = policy.select(memory.accumulator, it, group=group)
        finally:
            policy.fusion = None
        if fusion.accumulate is not None:  # the policy never read the accumulator
            memory.add_clipped(grad)
        return self._finish(it, chosen, None, host_loss, staged)

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

    def _proposal_round(self, it: int, fusion: Fusion):
        """Phase 1 of a two-phase round: the proposal back (a synchronisation), the group's
        indices up."""
        s, dev, policy = self.s, self.dev, self.s.policy
        proposal = policy.propose(s.memory.accumulator, it)
        if fusion.accumulate is not None:  # no proposal read the accumulator: fold it now
            s.memory.add_clipped(fusion.accumulate[2])
            fusion.accumulate = None
        pairs, finite_host = self._finite
        if proposal is None and not pairs:  # nothing to send: no copy
            idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        elif proposal is None:  # only the finiteness to read (a GradScaler's step)
            dev.copy_back(pairs)
            idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        else:
            idx, val = self.selections.copy_back(it, proposal, policy.max_propose, "propose",
                                                 pairs)
        if self._overflowed(finite_host):  # an overflowing worker proposes nothing
            idx, val = np.empty(0, np.int64), np.empty(0, np.float32)
        group = s.client.propose(it, idx.astype(np.int64, copy=False), val)
        return dev.upload("group", np.asarray(group, dtype=np.int64))

    def _finish(self, it, chosen, acc, host_loss, staged: bool, whole: bool = False):
        """The round's copy back: the selection (or the whole accumulator), the loss, the
        weights on checksum rounds."""
        s, dev = self.s, self.dev
        checksum_due = s.checksum_due(it)
        extra, loss_host, weights = self._extras(staged, checksum_due)
        finite_pairs, finite_host = self._finite
        extra = extra + finite_pairs
        if whole:
            values = dev.pinned("whole", self.numel, np.float32)
            dev.copy_back([(acc, values)] + extra)
            acc.fill(0)
            if s.memory.velocity is not None:
                s.memory.velocity.fill(0)
            s.memory.after_take()
            indices = s.all_indices()
        else:
            indices, values = self.selections.copy_back(it, chosen, s.policy.max_push, "select",
                                                        extra)
        host_loss, overflow = self._read_loss(it, host_loss, staged, loss_host)
        overflow = overflow or self._overflowed(finite_host)
        checksum = hashlib.blake2b(weights.data, digest_size=8).hexdigest() \
            if checksum_due else None
        if overflow:  # nothing of a non-finite gradient is sent; every worker skips the step
            indices, values = np.empty(0, np.int64), np.empty(0, np.float32)
        return indices, values, host_loss, checksum, overflow

    # -------------------------------------------------------------------------- aggregate
    def apply(self, agg, it: int) -> None:
        """A round in parts: its merged aggregate applied as a whole round's is, timed."""
        dev = self.dev
        with dev.stream_scope():
            if self._apply_marks is not None:
                self._time_device("apply", *self._apply_marks)
            begin = dev.mark()
            self._apply(agg, it)
            self._apply_marks = (begin, dev.mark())
            dev.lead_torch()
        dev.end_round()

    def _apply(self, agg, it: int) -> None:
        """The aggregate up (once), observed by the policy there, into the gradient."""
        s, dev, xp = self.s, self.dev, self.dev.xp
        s.note_live(agg)
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
        s.applied(it)

    def _buffer(self, name: str, size: int, dtype):
        """A device buffer of at least ``size`` entries (grown, never shrunk), its first
        ``size``."""
        held = getattr(self, name)
        if held.size < size:
            held = self.dev.xp.zeros(max(size, 2 * held.size), dtype=dtype)
            setattr(self, name, held)
        return held[:size]
