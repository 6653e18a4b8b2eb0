"""One worker's round on the host (``HostRound``): its shapes, its clock and its context.

One worker's round on the host: what a round sends, the clock every round shares, and the
context rounds work in (docs/architecture.md, "One iteration").

A round runs between a training loop's ``loss.backward()`` and its ``optimizer.step()``: fold
the gradient into the error-feedback accumulator, let the policy choose, push, receive the
aggregate, let the policy observe it, write it into ``.grad``. Three things decide what it
sends, one class each (a *round shape*): ``OnePhase`` (the policy selects), ``TwoPhase`` (a
proposal round first: ``cltk``, ``vote``) and ``WholeModel`` (the budget is the whole model:
nothing to select). ``HostRound`` runs them on the host; ``psparse.worker.device_round.DeviceRound``
is the same round on a GPU; ``psparse.worker.parts.Parts`` the same round in buckets of layers.

Rounds see the worker through a ``RoundContext`` (its parts and a few callbacks), never the
``Session`` itself, and keep time on one ``RoundClock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cpu.sparsify import NonFiniteError, topk_exact
from ..policies import check_output
from ..xp import INDEX_DTYPE, to_device, to_host
from .divergence import accumulator_diverged, read_loss, require_scaler


class RoundClock:
    """A worker's time split: ``compute_s`` (everything between rounds: data, forward,
    backward, applying, the optimizer), ``select_s`` (accumulating, selecting, any proposal
    round) and ``wait_s`` (from the push to the aggregate)."""

    def __init__(self):
        self.times = {"compute_s": 0.0, "select_s": 0.0, "wait_s": 0.0}
        self.last = time.perf_counter()  # when the previous round returned

    def begin(self) -> float:
        """A round starts: the time since the last one was compute."""
        now = time.perf_counter()
        self.times["compute_s"] += now - self.last
        return now

    def add(self, name: str, seconds: float) -> None:
        self.times[name] += seconds

    def end(self, since: float) -> None:
        """The round returns: the time since ``since`` (the aggregate's arrival) was compute."""
        self.last = time.perf_counter()
        self.times["compute_s"] += self.last - since

    def restart(self) -> None:
        """Registration done (or a resume): compute is counted from now."""
        self.last = time.perf_counter()


@dataclass
class RoundContext:
    """What a worker's rounds work with. ``budget(it)``: the k of iteration it (lower during
    a density warm-up); ``note_live(agg)``: an aggregate naming fewer live ranks (an elastic
    run lost some) reaches the worker before its policy observes it; ``applied(it)``: the
    worker's bookkeeping once iteration it's aggregate is in ``.grad``; ``before(it)``: what
    precedes a round (its checks and any checkpoint due), and ``iteration()``: the next round's
    number, for rounds that start outside ``exchange`` (a bucket's autograd hook)."""

    cfg: object
    net: object
    memory: object
    policy: object
    client: object
    budget: Callable[[int], int]
    note_live: Callable[[object], None]
    applied: Callable[[int], None]
    before: Callable[[int], None]
    iteration: Callable[[], int]
    say: Callable[[str], None] = print
    recorder: object = None
    probe: object = None  # --probe-recall (psparse.worker.recall.RecallProbe), or None
    scaling: object = None  # this step's GradScaler handling (psparse.worker.amp), or None
    clock: RoundClock = field(default_factory=RoundClock)
    _dense: np.ndarray | None = None
    _arange: np.ndarray | None = None

    def checksum_due(self, it: int) -> bool:
        return it % self.cfg.check_every == 0

    def set_budget(self, it: int) -> int:
        k = self.budget(it)
        if k != self.policy.k:
            self.policy.set_k(k)
        return k

    def dense_buffer(self) -> np.ndarray:
        """The dense push's buffer, reused: the previous push left once its aggregate came."""
        if self._dense is None:
            self._dense = np.empty(self.net.numel, dtype=np.float32)
        return self._dense

    def all_indices(self) -> np.ndarray:
        """Every index of the model, made once (a dense aggregate's)."""
        if self._arange is None:
            self._arange = np.arange(self.net.numel, dtype=np.int64)
        return self._arange


def select(ctx: RoundContext, acc, it: int, group):
    """The policy's indices and their accumulator values (zeroed there)."""
    indices = ctx.policy.select(acc, it, group=group)
    check_output(ctx.policy, indices, it, ctx.policy.max_push)  # before anything is sent
    indices = indices.astype(INDEX_DTYPE, copy=False)  # the kernels take int64 (xp.py)
    return indices, ctx.memory.take(indices)


# ------------------------------------------------------------------------------ round shapes
# A round shape decides what a round sends: ``choose(ctx, it, accumulator)`` returns the
# (indices, values) to push, taken out of the accumulator; the rest of a round (accumulate
# before, push and apply after) is the same for every shape.
class OnePhase:
    """The policy selects from the accumulator; those entries are pushed."""

    def choose(self, ctx: RoundContext, it: int, acc):
        return select(ctx, acc, it, None)


class TwoPhase:
    """The policy proposes indices, the server keeps the group's choice, the policy selects
    with that choice in hand (``cltk``, ``vote``)."""

    def choose(self, ctx: RoundContext, it: int, acc):
        policy = ctx.policy
        proposal = policy.propose(acc, it)
        if proposal is None:
            proposal = np.empty(0, dtype=np.int64)
        check_output(policy, proposal, it, policy.max_propose, "propose")
        proposal = proposal.astype(INDEX_DTYPE, copy=False)
        group = ctx.client.propose(it, proposal, acc[proposal])
        return select(ctx, acc, it, np.asarray(group, dtype=INDEX_DTYPE))


class WholeModel:
    """The budget is the whole model (density 1): every entry is sent, no selection. (Not to
    be confused with a *dense push*, the encoding ``client.push`` picks when all values are
    smaller than (index, value) pairs.)"""

    def choose(self, ctx: RoundContext, it: int, acc):
        everything = ctx.all_indices()
        return everything, ctx.memory.take(everything)


def budget_steps(policy, k_at, iterations: int, warmup: bool, start: int) -> list[list[int]]:
    """[from_iteration, budget, push_max, propose_max] wherever the budget ``k_at(it)`` changes
    (only during a density warm-up); push_max and propose_max are what the policy declares for
    that budget. The policy is left at iteration ``start``'s budget."""
    steps = []
    for it in range(iterations if warmup else 1):
        k = k_at(it)
        if not steps or steps[-1][1] != k:
            policy.set_k(k)
            steps.append([it, k, policy.max_push, policy.max_propose])
    policy.set_k(k_at(start))
    return steps


def round_shape(policy, whole: bool):
    """A two-phase policy keeps its proposal phase even at density 1 (the run says so)."""
    return TwoPhase() if policy.two_phase else WholeModel() if whole else OnePhase()


# ----------------------------------------------------------------------------- host rounds
class HostRound:
    """A round on the host (a CPU worker, or a GPU worker without CuPy)."""

    def __init__(self, ctx: RoundContext, shape):
        self.ctx, self.shape = ctx, shape

    def exchange(self, it: int, loss) -> None:
        ctx = self.ctx
        scaling = ctx.scaling  # a GradScaler's step (psparse.worker.amp), or None
        loss, overflow = read_loss(loss, it, scaling)
        t1 = ctx.clock.begin()
        k = ctx.set_budget(it)
        ctx.net.gather_grad()
        if scaling is not None:  # unscaled before anything reads it
            scaling.save(ctx.memory)
            overflow = scaling.unscale(ctx.net.grad) or overflow
        grad = ctx.net.grad_array()
        recorder = ctx.recorder if not overflow else None
        host_grad = to_host(grad) if recorder else None  # read before the next backward
        grad_topk = topk_exact(host_grad, k) if recorder else None
        if overflow:  # nothing of a non-finite gradient reaches the accumulator
            indices, values = scaling.nothing(ctx, it)
        else:
            acc = ctx.memory.add(grad)  # error feedback: carry what was not sent
            # the push empties the sent entries: keep what the policy chose from
            host_acc = to_host(acc).copy() if recorder else None
            probe = ctx.probe if ctx.probe is not None and ctx.probe.due(it) else None
            if probe is not None:  # before the push: the aggregate comes after every file
                probe.save(it, to_host(acc))
            try:
                indices, values = self.shape.choose(ctx, it, acc)
            except NonFiniteError as exc:  # selection refuses an accumulator with NaN or inf
                raise accumulator_diverged(it, str(exc)) from None
            if recorder:
                recorder.record(host_grad, grad_topk, to_host(indices), host_acc)
        t2 = time.perf_counter()
        checksum = ctx.net.checksum() if ctx.checksum_due(it) else None
        agg = ctx.client.push(it, indices, values, loss, checksum, ctx.dense_buffer(),
                              overflow=overflow)
        t3 = time.perf_counter()
        if agg.get("overflow"):  # some worker overflowed: every worker skips this step
            if ctx.probe is not None and ctx.probe.due(it):
                ctx.probe.discard(it)
            self.skip(agg, it)
        else:
            self.apply(agg, it)
            if scaling is not None:
                scaling.rescale(ctx.net)
            if ctx.probe is not None and ctx.probe.due(it):
                ctx.probe.reduce(it, ctx.all_indices() if agg.get("dense") else agg.indices, k)
        ctx.clock.add("select_s", t2 - t1)
        ctx.clock.add("wait_s", t3 - t2)
        ctx.clock.end(t3)

    def skip(self, agg, it: int) -> None:
        """A round the server flagged as an overflow (a GradScaler's): the memory as before
        the step, ``.grad`` inf, nothing observed; the iteration is done."""
        ctx = self.ctx
        require_scaler(ctx, it)
        ctx.scaling.skip(ctx.net, ctx.memory)
        ctx.note_live(agg)
        ctx.applied(it)

    def apply(self, agg, it: int) -> None:
        """The round's aggregate: the policy observes it, it lands in .grad; the iteration
        is done."""
        ctx = self.ctx
        ctx.note_live(agg)
        if agg.get("dense"):
            ctx.policy.observe(*to_device(np, ctx.all_indices(), agg.values), it)
            ctx.net.set_grad(None, agg.values)
        else:
            ctx.policy.observe(*to_device(np, agg.indices, agg.values), it)
            ctx.net.set_grad(agg.indices, agg.values)
        ctx.applied(it)
