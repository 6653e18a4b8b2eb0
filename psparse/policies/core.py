"""core: a shared core of indices chosen from the aggregate history, plus a small own slice.

Shared state (identical on every worker, built from the aggregates):
    priority <- beta * priority;  priority[i] += (1 - beta) * |aggregate_i|
(with ``signed=true``: the EMA of the signed aggregate, ranked by its magnitude)

Each round, per slice, with budget k:
    core = the (1 - own) * k indices of highest priority (only indices with priority > 0)
    mine = the remaining budget from this worker's largest |accumulator| outside the core
Every worker sends the same core, so the union is |core| + at most N * own * k:
union / k <= (1 - own) + N * own  (1.875 for N = 8, own = 0.125).
That bound grows with N: at N = 32 it is 4.875, and measured union / k follows it upward
(issue 18). With ``private=p`` (p > 0) the own slices of all workers together take p * k, each
worker's own = p / N (N: the workers still in the run), so union / k <= 1 + p - p / N at any
N; ``private=1`` is the default ``own`` at N = 8 and keeps the union under 2k at every N.

Why it keeps accuracy: the own slice lets each worker push what is large for it; once the group
has seen an index large in the aggregate, it enters everyone's core for a while (gradient
magnitude is concentrated on few indices over short periods), and error feedback carries every
entry not yet sent, so nothing is dropped.

Cost (issue 18, item 3): about one top-k of the accumulator, for exactly the selection of the
rule above. The priority decays lazily (``kernels.Decaying``: one scale factor, so ``observe``
touches only the aggregate's entries, and no subnormal is multiplied every round). The core is
searched among candidates only (a partition of the whole priority vector, mostly zeros, was 60x
slower than of as many distinct values): the indices aggregated since the last search, plus the
best core_k + core_k / 4 found then; every other index's stored priority is at most ``bound`` (stored
values that are not aggregated do not change). When the core's last entry beats the bound,
the candidates hold the whole core; otherwise (and after a renormalisation) the nonzero entries
are searched again. The own slice is the top k - |core| of |accumulator| with the core masked
out (the reference rule): on a small host slice one partition, whose answer mask also takes
the core; on a large one scored and selected a block at a time (``Selector.topk_scored``),
which finds k - |core| entries instead of a top-k's k.
"""

import numpy as np

from .. import kernels
from ..sparsify import positions, topk_exact
from .base import Param, SelectionPolicy


class SharedCore(SelectionPolicy):
    name = "core"
    params = {
        "own": Param(float, 0.125, "fraction of k each worker picks from its own top entries",
                     lambda v: 0 <= v <= 1, "in [0, 1]"),
        "private": Param(float, 0.0, "if > 0: the fraction of k that all workers' own slices "
                         "take together, each worker's own = private / N (replaces own); the "
                         "union then stays under (1 + private) k however many workers",
                         lambda v: 0 <= v <= 1, "in [0, 1]"),
        "beta": Param(float, 0.5, "EMA decay of the shared priority", lambda v: 0 <= v < 1,
                      "in [0, 1)"),
        "signed": Param(bool, False, "rank the core by |EMA of the signed aggregate| (noise "
                        "that flips sign cancels) instead of the EMA of |aggregate|"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = kernels.Decaying(layout.numel, self.xp)
        self._mag = self.xp.empty(layout.numel, dtype=self.xp.float32)  # scratch
        self._forget()

    def _forget(self):
        # per slice: candidate indices (sorted, slice-relative; None: search the whole slice)
        # and the bound on |stored priority| of every index that is not a candidate
        self._candidates = [None] * len(self.layout.slices)
        self._bound = [np.float32(0)] * len(self.layout.slices)

    def select_slice(self, acc, k, offset):
        xp = self.xp
        core = self._core(offset, acc.size, k - int(round(self.own_share * k)))
        if core.size == k:
            return core
        mag = self._mag[offset:offset + acc.size]
        if xp is np and self._selectors[self._slice_index(offset)].exact:
            # a small host slice: one partition of |acc| with the core masked out, the core
            # marked in the same mask (the sorted union for free)
            np.abs(acc, out=mag)
            mag[core] = 0.0
            return topk_exact(mag, k - core.size, nonnegative=True, also=core)

        def score(sl, out):  # |acc| with the core masked out: it is sent anyway
            xp.abs(acc[sl], out=out)
            out[positions(core, sl, acc.size)] = 0.0
        mine = self.topk_scored(score, k - core.size, offset, mag)
        return kernels.sorted_union([core, mine])

    @property
    def own_share(self) -> float:
        """The fraction of k this worker picks from its own top entries."""
        return self.private / len(self.live) if self.private > 0 else self.own

    def _core(self, offset, size, core_k):
        """The core_k indices of largest |priority| > 0 in a slice (all of them if fewer)."""
        xp = self.xp
        if core_k <= 0:
            return xp.empty(0, dtype=xp.int64)
        s = self._slice_index(offset)
        prio = self.priority.stored[offset:offset + size]  # ranks as the priority does
        for search in (False, True):
            if search or self._candidates[s] is None:  # every nonzero entry is a candidate
                self._candidates[s] = xp.flatnonzero(prio != 0)
                self._bound[s] = np.float32(0)
            candidates, bound = self._candidates[s], self._bound[s]
            values = xp.abs(prio[candidates])
            n = candidates.size
            keep_k = core_k + (core_k + 3) // 4  # what a prune keeps: the core and a spare
            prune = n > keep_k  # then also find the keep_k-th, to prune with
            if n > core_k:
                part = xp.partition(values, [n - keep_k, n - core_k] if prune else n - core_k)
                kth = np.float32(float(part[n - core_k]))
                if kth > bound:  # it beats every non-candidate: the core is exact
                    break
            if bound == 0:  # fewer than core_k nonzero entries, all candidates: all of them
                return candidates[values > 0]
        keep = values > kth
        short = core_k - int(xp.count_nonzero(keep))
        if short:  # ties at the core_k-th: the lowest indices (candidates are sorted)
            keep[xp.flatnonzero(values == kth)[:short]] = True
        if prune:  # keep the best keep_k; what is dropped is at most the new bound
            bound = max(bound, np.float32(float(part[n - keep_k])))
            self._candidates[s], self._bound[s] = candidates[values > bound], bound
        return candidates[keep]

    def observe(self, indices, values, iteration):
        if self.priority.decay(self.beta):
            self._forget()  # the stored values were rescaled: the bounds no longer hold
        self.priority.add(indices, values, 1.0 - self.beta, magnitude=not self.signed)
        for s, (lo, hi) in enumerate(kernels.slice_bounds(indices, self.layout.slices)):
            if self._candidates[s] is not None and hi > lo:
                offset = self.layout.slices[s][0]
                self._candidates[s] = kernels.sorted_union([self._candidates[s],
                                                            indices[lo:hi] - offset])

    def state_dict(self):
        return self.priority.state_dict()

    def load_state_dict(self, state):
        self.priority.load_state_dict(state)
        self._forget()
