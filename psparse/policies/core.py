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

Cost (issue 18, item 3): about one top-k of the accumulator, for exactly the selection of the rule
above. The priority decays lazily (``updates.Decaying``: one scale factor, so ``observe`` touches
only the aggregate's entries, and no subnormal is multiplied every round). The core is searched
among candidates only (a partition of the whole priority vector, mostly zeros, was 60x slower than
of as many distinct values): the entries at or above the last core's smallest stored priority, plus
those aggregated up to it since; every other entry is below that floor (stored values that are not
aggregated do not change). When the new core's smallest value reaches the floor the candidates hold
the whole core; otherwise (a larger budget, a signed priority that fell, a renormalisation) the
nonzero entries are searched again. When every candidate was aggregated (every worker sends the
core, so usually), the new candidates are the aggregated entries at or above the floor, with no
merge: on small host slices the scatter keeps the old values, which tell (how many of the aggregate
were at or above the floor before). The own slice is the top k - |core| of |accumulator| outside the
core: the k largest of |accumulator| with the core's entries at float32's maximum (so they rank
first and the rest of the budget goes to the largest others, zeros included, never to a core entry
twice): on the host compiled (``select_kernels.top_k``, kind CORE: the pass's candidates merged with
the core); its numpy reference one partition on a small slice, on a large one scored and selected a
block at a time (``Selector.topk_scored``). On the device (``select_device``) the same rule: the
core by an engine over the priority that leaves out zero keys, marked in a byte mask, then one
engine over the combined key.
"""

import numpy as np

from ..ops.jit import host_compiled
from ..ops.select import radix, selection
from ..ops.select.sparsify import positions, select_kernels, topk_exact
from .base import Param, SelectionPolicy

CORE_SCORE = np.finfo(np.float32).max  # the core's score: above every other entry's |acc|


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
        self.priority = self.backend.decaying(layout.numel)
        self._forget()
        # the core as an engine that ranks every key reads it: a byte mask on the device (the
        # host's set holds none); the host's per-slice search scores into _mag (made when needed)
        self.core_set = self.backend.index_set(layout.numel)
        self._mag = None

    def select_device(self, accumulator, iteration, group=None):
        """The core (per slice, the largest nonzero priorities: an engine that leaves out zero
        keys), marked in a mask; then the k largest of |acc| with the core at float32's
        maximum (the core and the rest of the budget in one selection); the mask cleared."""
        core_ks = [k - int(round(self.own_share * k)) for k in self.slice_k]
        core = self.engines.select(
            "core", radix.Key(radix.KEY_PRIORITY, accumulator, aux=self.priority.stored,
                              p0=float(self.signed)), core_ks, None, final=False,
            values=False, exclude_zero=True)
        in_core = self.core_set.mask
        self.engines.mark(core, in_core, 1)
        chosen = self.engines.select("select", radix.Key(radix.KEY_CORE, accumulator,
                                                         mask=in_core), self.slice_k,
                                     self.fusion)
        self.engines.mark(core, in_core, 0)
        return chosen

    def _forget(self):
        # per slice: candidate indices (sorted, slice-relative; None: search the whole slice)
        # and the floor every other entry's |stored priority| is below (or it is zero)
        self._candidates = [None] * len(self.layout.slices)
        self._floor = [np.float32(0)] * len(self.layout.slices)

    def select_slice(self, acc, k, offset):
        xp = self.xp
        core = self._core(offset, acc.size, k - int(round(self.own_share * k)))
        if core.size == k:
            return core
        selector = self._selectors[self._slice_index(offset)]
        if host_compiled(acc):  # |acc| with the core at float32's maximum, compiled
            return selector.scored(acc, k, select_kernels.CORE, None,
                                   np.ascontiguousarray(core, dtype=np.int64))
        if self._mag is None:
            self._mag = xp.empty(self.layout.numel, dtype=xp.float32)
        mag = self._mag[offset:offset + acc.size]
        if xp is np and selector.exact:
            # a small host slice: one partition of |acc| with the core at the top
            np.abs(acc, out=mag)
            mag[core] = CORE_SCORE
            return topk_exact(mag, k, nonnegative=True)

        def score(sl, out):  # |acc| with the core at float32's maximum: it is sent anyway
            xp.abs(acc[sl], out=out)
            out[positions(core, sl, acc.size)] = CORE_SCORE
        return self.topk_scored(score, k, offset, mag)

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
                self._candidates[s], self._floor[s] = xp.flatnonzero(prio), np.float32(0)
            candidates, floor = self._candidates[s], self._floor[s]
            values = self._magnitude(prio[candidates])
            n = candidates.size
            if n >= core_k:
                kth = np.float32(float(xp.partition(values, n - core_k)[n - core_k]))
                if kth >= floor:  # every other entry is below floor: the core is exact
                    break
            elif floor == 0:  # every other entry is zero
                kth = np.float32(0)
                break
        if kth == 0:  # fewer than core_k nonzero entries (floor 0: all candidates): all of them
            return candidates[values > 0]
        # the next search's candidates: those at or above the core's smallest value
        reached = candidates[values >= kth]
        self._candidates[s], self._floor[s] = reached, kth
        if reached.size == core_k:  # no ties beyond the core: it is the core
            return reached
        return candidates[self._best(values, kth, core_k)]

    def _best(self, values, kth, k):
        """Mask of the k largest values, whose k-th is kth; ties at kth to the lowest indices
        (candidates are sorted)."""
        xp = self.xp
        keep = values > kth
        short = k - int(xp.count_nonzero(keep))
        if short:
            keep[xp.flatnonzero(values == kth)[:short]] = True
        return keep

    def observe(self, indices, values, iteration):
        if self.priority.decay(self.beta):  # (the device's decides on the device: None)
            self._forget()  # the stored values were rescaled: the bounds no longer hold
        if all(c is None for c in self._candidates):
            # no candidates to keep up to date: the device's selection ranks every key and
            # keeps none, and the host's next search starts from every nonzero entry
            self.priority.add(indices, values, 1.0 - self.beta, magnitude=not self.signed)
            return
        xp = self.xp
        small = xp is np and all(selector.exact for selector in self._selectors)
        if host_compiled(self.priority.stored):  # compiled: the old values come with it
            updated = np.empty(indices.size, np.float32)
            old = np.empty(indices.size, np.float32) if small else None
            self.priority.add_compiled(indices, values, 1.0 - self.beta,
                                       magnitude=not self.signed, out=updated, old=old)
        elif small and indices.size:  # the scatter by hand, keeping the old values
            priority = self.priority
            add = np.float32((1.0 - self.beta) / priority.scale) * \
                (values if self.signed else np.abs(values))  # as Decaying.add: bit-identical
            old = priority.stored[indices]
            updated = (old + add).astype(np.float32, copy=False)  # rounded once, as there
            priority.stored[indices] = updated
        else:
            old = None
            updated = xp.empty(indices.size, dtype=xp.float32)  # stored[indices]
            self.priority.add(indices, values, 1.0 - self.beta, magnitude=not self.signed,
                              out=updated)
        for s, (lo, hi) in enumerate(selection.slice_bounds(indices, self.layout.slices)):
            if self._candidates[s] is None or hi == lo:
                continue
            floor = self._floor[s]
            grown = indices[lo:hi][self._magnitude(updated[lo:hi]) >= floor]  # reached floor
            offset = self.layout.slices[s][0]
            if offset:
                grown = grown - offset
            if old is not None and \
                    int(xp.count_nonzero(self._magnitude(old[lo:hi]) >= floor)) == \
                    self._candidates[s].size:
                # every candidate was aggregated (each is at or above floor, every other entry
                # below it, so these are they): the entries at or above floor are those grown
                self._candidates[s] = grown
            else:
                self._candidates[s] = selection.sorted_union([self._candidates[s], grown])

    def _magnitude(self, stored):
        """|stored priority| (unsigned: it is >= 0 already)."""
        return self.xp.abs(stored) if self.signed else stored

    def state_dict(self):
        return self.priority.state_dict()

    def load_state_dict(self, state):
        self.priority.load_state_dict(state)
        self._forget()  # the host's bounds (the device keeps none)
