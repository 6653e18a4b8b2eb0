"""One worker's round, written once for the host and the GPU, whole or in parts.

A round runs between a training loop's ``loss.backward()`` and its ``optimizer.step()``
(docs/architecture.md, "One iteration"):

    accumulate -> choose -> take -> (round values) -> push -> apply

``Round.exchange`` runs it for the whole model in one message; ``psparse.worker.parts.Parts``
runs it in buckets of layers (``Round.send_part`` per bucket, then ``Round.finish``). What
depends on where the arrays live is an *engine*'s: ``HostEngine`` below (numpy and the CPU
kernels), or ``psparse.worker.device_round.DeviceEngine`` (a GPU's, or the strict emulator's).
An engine answers these calls:

* ``stage_loss(it, loss)``: the loss, as the engine reads it (the host now; the GPU with the
  round's one copy back);
* ``take(it, part, staged)``: fold the gradient into the error-feedback memory (unscaled first
  under a GradScaler), choose, take the chosen entries out: the ``Sent`` that goes on the wire.
  The whole model's choice is the round shape's (``exchange.OnePhase``, ``TwoPhase``,
  ``WholeModel``), which calls the engine's ``select``, ``proposal`` and ``everything``; a
  part's is one selection per layer;
* ``apply(agg, it)``: the policy observes the aggregate, which lands in ``.grad``;
* ``restore()``: an overflowed step's memory as it was before the step;
* ``scope()`` and ``end_round()``: the device stream the work goes on, and the round's end.

Everything else is here once: the clock, the push, a GradScaler's skip and rescale, the recall
probe's bookkeeping, and the order in which the session learns of the aggregate.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from ..ops.select.sparsify import NonFiniteError, topk_exact
from ..policies import PolicyError, check_output
from ..xp import INDEX_DTYPE, to_device, to_host
from .divergence import accumulator_diverged, read_loss, require_scaler
from .exchange import RoundContext

NO_INDICES = np.empty(0, dtype=INDEX_DTYPE)
NO_VALUES = np.empty(0, dtype=np.float32)


@dataclass(frozen=True)
class Part:
    """One bucket of a round in parts: layers [first, end), keys [lo, hi). Part 0 (the
    first layers, ready last) carries the loss and the checksum."""

    index: int
    first: int
    end: int
    lo: int
    hi: int


@dataclass
class Sent:
    """What a worker pushes for a round (or a part): the chosen keys and their values (taken
    out of the accumulator), the loss, the weights' checksum when due, and whether this
    worker's gradient overflowed (then nothing is sent; every rank skips the step)."""

    indices: np.ndarray
    values: np.ndarray
    loss: float | None = None
    checksum: str | None = None
    overflow: bool = False


def carries_extras(part: Part | None) -> bool:
    """Whether a push carries the loss and the checksum: a whole round's, or part 0's."""
    return part is None or part.index == 0


class Round:
    """The control flow of a worker's rounds (see the module docstring)."""

    def __init__(self, ctx: RoundContext, engine):
        self.ctx, self.engine = ctx, engine

    def exchange(self, it: int, loss) -> None:
        """A whole-model round: one push, its aggregate applied."""
        ctx, engine = self.ctx, self.engine
        staged = engine.stage_loss(it, loss)
        t1 = ctx.clock.begin()
        ctx.set_budget(it)
        ctx.net.gather_grad()
        # the push inside the engine's scope too: a push rounded on the host (--values) feeds
        # its rounding error back into the memory, on the device's stream
        with engine.scope():
            sent = engine.take(it, None, staged)
            t2 = time.perf_counter()
            agg = ctx.client.push(it, sent.indices, sent.values, sent.loss, sent.checksum,
                                  ctx.dense_buffer(), overflow=sent.overflow)
            t3 = time.perf_counter()
        self.finish(agg, it)
        ctx.clock.add("select_s", t2 - t1)
        ctx.clock.add("wait_s", t3 - t2)
        ctx.clock.end(t3)

    def send_part(self, it: int, part: Part, staged=None) -> None:
        """One bucket of a round in parts (its layers' gradients gathered): taken and sent;
        its aggregate comes with the others' (``client.await_parts``)."""
        with self.engine.scope():  # the send too: its rounding error goes to the memory
            sent = self.engine.take(it, part, staged)
            self.ctx.client.send_part(it, part.index, sent.indices, sent.values, sent.loss,
                                      sent.checksum, overflow=sent.overflow)

    def stage_loss(self, it: int, loss):
        """The loss as the engine reads it (a round in parts stages it before its last push)."""
        return self.engine.stage_loss(it, loss)

    def finish(self, agg, it: int) -> None:
        """The round's aggregate: applied (then rescaled for a GradScaler), or, flagged as an
        overflow by the server, the step skipped on this rank as on every other."""
        ctx, engine = self.ctx, self.engine
        probe = ctx.probe if ctx.probe is not None and ctx.probe.due(it) else None
        if agg.get("overflow"):
            require_scaler(ctx, it)
            with engine.scope():
                engine.restore()
            ctx.scaling.poison(ctx.net)  # .grad all inf: scaler.step skips, update backs off
            ctx.note_live(agg)
            if probe is not None:
                probe.discard(it)
            ctx.applied(it)
        else:
            ctx.note_live(agg)  # fewer live ranks reach the policy before it observes
            with engine.scope():
                engine.apply(agg, it)
            ctx.applied(it)
            if ctx.scaling is not None:
                ctx.scaling.rescale(ctx.net)
            if probe is not None:
                probe.reduce(it, ctx.all_indices() if agg.get("dense") else agg.indices,
                             ctx.policy.k)
        engine.end_round()


class HostEngine:
    """Rounds on the host: numpy arrays and the CPU kernels (a CPU worker, or a GPU worker
    without CuPy, whose gradient is copied to pinned host memory)."""

    def __init__(self, ctx: RoundContext, shape):
        self.ctx, self.shape = ctx, shape
        self._saved_at = None  # the iteration whose memory a GradScaler's skip restores

    @staticmethod
    def scope():
        return contextlib.nullcontext()

    def end_round(self) -> None:
        pass

    def stage_loss(self, it: int, loss):
        """(the loss, whether it overflowed): read now."""
        return read_loss(loss, it, self.ctx.scaling)

    def take(self, it: int, part: Part | None, staged) -> Sent:
        ctx = self.ctx
        loss, overflow = staged if staged is not None else (None, False)
        grad = ctx.net.grad_array() if part is None else ctx.net.grad_range(part.lo, part.hi)
        if ctx.scaling is not None:  # unscaled before the memory sees it (psparse.worker.amp)
            if self._saved_at != it:  # the memory to restore if the step is skipped
                ctx.scaling.save(ctx.memory)
                self._saved_at = it
            overflow = ctx.scaling.unscale(grad) or overflow
        checksum = ctx.net.checksum() if carries_extras(part) and ctx.checksum_due(it) else None
        if overflow:  # nothing of a non-finite gradient reaches the accumulator
            if part is None and ctx.policy.two_phase:  # the others wait for its proposal
                ctx.client.propose(it, NO_INDICES, NO_VALUES)
            return Sent(NO_INDICES, NO_VALUES, loss, checksum, True)
        try:
            if part is None:
                indices, values = self._whole(it, grad)
            else:
                indices, values = self._part(it, part, grad)
        except NonFiniteError as exc:  # selection refuses an accumulator with NaN or inf
            raise accumulator_diverged(it, str(exc)) from None
        return Sent(indices, values, loss, checksum)

    def _whole(self, it: int, grad):
        """The round shape's choice over the whole accumulator, with --record-selections and
        --probe-recall (whole-model host rounds only: the options say so) looking on."""
        ctx = self.ctx
        recorder, probe = ctx.recorder, ctx.probe
        grad_topk = topk_exact(grad, ctx.policy.k) if recorder else None
        acc = ctx.memory.add(grad)  # error feedback: carry what was not sent
        # the push empties the sent entries: keep what the policy chose from
        host_acc = to_host(acc).copy() if recorder else None
        if probe is not None and probe.due(it):  # before the push: the aggregate comes
            probe.save(it, to_host(acc))  # after every worker's file
        indices, values = self.shape.choose(ctx, it, acc, self)
        if recorder:
            recorder.record(grad, grad_topk, to_host(indices), host_acc)
        return indices, values

    def _part(self, it: int, part: Part, grad):
        """A bucket: its keys folded in, each layer's selection (``select_slice``, each
        layer's k as in a whole ``--granularity layer`` round), taken."""
        ctx, policy = self.ctx, self.ctx.policy
        acc = ctx.memory.add_range(grad, part.lo, part.hi)
        chosen = []
        for layer in range(part.first, part.end):
            k, offset = policy.slice_k[layer], policy.layout.slices[layer][0]
            if k > 0:
                size = ctx.net.layer_sizes[layer]
                chosen.append(policy.select_slice(acc[offset:offset + size], k, offset) + offset)
        indices = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)
        check_output(policy, indices, it, policy.max_push)
        if indices.size and (int(indices[0]) < part.lo or int(indices[-1]) >= part.hi):
            raise PolicyError(f"policy {type(policy).__name__}.select_slice() at iteration "
                              f"{it} chose an index outside its layer")
        indices = indices.astype(INDEX_DTYPE, copy=False)
        return indices, ctx.memory.take(indices)

    # the round shapes' steps (exchange.OnePhase, TwoPhase, WholeModel)
    def select(self, it: int, acc, group):
        """The policy's indices (checked before anything is sent) and their accumulator values,
        zeroed there."""
        ctx = self.ctx
        if group is not None:
            group = np.asarray(group, dtype=INDEX_DTYPE)
        indices = ctx.policy.select(acc, it, group=group)
        check_output(ctx.policy, indices, it, ctx.policy.max_push)
        indices = indices.astype(INDEX_DTYPE, copy=False)  # the kernels take int64 (xp.py)
        return indices, ctx.memory.take(indices)

    def proposal(self, it: int, acc, proposal):
        """A two-phase policy's proposal, checked, with its accumulator values."""
        policy = self.ctx.policy
        if proposal is None:
            proposal = NO_INDICES
        check_output(policy, proposal, it, policy.max_propose, "propose")
        proposal = proposal.astype(INDEX_DTYPE, copy=False)
        return proposal, acc[proposal]

    def everything(self, it: int, acc):
        everything = self.ctx.all_indices()
        return everything, self.ctx.memory.take(everything)

    # ------------------------------------------------------------------------- aggregate
    def apply(self, agg, it: int) -> None:
        """The policy observes the aggregate; it lands in ``.grad``."""
        ctx = self.ctx
        if agg.get("dense"):
            ctx.policy.observe(*to_device(np, ctx.all_indices(), agg.values), it)
            ctx.net.set_grad(None, agg.values)
        else:
            ctx.policy.observe(*to_device(np, agg.indices, agg.values), it)
            ctx.net.set_grad(agg.indices, agg.values)

    def restore(self) -> None:
        self.ctx.scaling.restore(self.ctx.memory)
