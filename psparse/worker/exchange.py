"""What every worker round works with: its context, its clock and its shapes.

The round itself is ``psparse.worker.round`` (written once for the host and the GPU, whole or
in parts). Three things decide what a whole-model round sends, one class each (a *round
shape*): ``OnePhase`` (the policy selects), ``TwoPhase`` (a proposal round first: ``cltk``,
``vote``) and ``WholeModel`` (the budget is the whole model: nothing to select). Rounds see the
worker through a ``RoundContext`` (its parts and a few callbacks), never the ``Session``
itself, and keep time on one ``RoundClock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


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


# ------------------------------------------------------------------------------ round shapes
# A round shape decides what a whole-model round sends: ``choose(ctx, it, acc, engine)`` returns
# what the engine's ``select`` or ``everything`` returns (the host: the (indices, values) taken
# out of the accumulator; the GPU: the selection on the device, taken with the round's copy
# back). The rest of a round is the same for every shape (psparse.worker.round).
class OnePhase:
    """The policy selects from the accumulator; those entries are pushed."""

    def choose(self, ctx: RoundContext, it: int, acc, engine):
        return engine.select(it, acc, None)


class TwoPhase:
    """The policy proposes indices, the server keeps the group's choice, the policy selects
    with that choice in hand (``cltk``, ``vote``)."""

    def choose(self, ctx: RoundContext, it: int, acc, engine):
        indices, values = engine.proposal(it, acc, ctx.policy.propose(acc, it))
        group = ctx.client.propose(it, indices, values)
        return engine.select(it, acc, group)


class WholeModel:
    """The budget is the whole model (density 1): every entry is sent, no selection. (Not to
    be confused with a *dense push*, the encoding ``client.push`` picks when all values are
    smaller than (index, value) pairs.)"""

    def choose(self, ctx: RoundContext, it: int, acc, engine):
        return engine.everything(it, acc)


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
