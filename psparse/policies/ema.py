"""ema: blend each worker's |accumulator| with the group's recent aggregate magnitudes.

    priority <- beta * priority;  priority[i] += (1 - beta) * |aggregate_i|    (shared state)
    score_i   = |acc_i| * (1 + lam * priority_i / max(priority))

and the k largest scores are sent. An index the group has recently found large gets up to
(1 + lam) times the weight, so workers lean toward the same indices while a locally huge entry
still wins. (This is the blended-score variant; the candidate scheme is ``frequency``.)

Cost (issue 18, item 3): the priority decays lazily (``updates.Decaying``: one scale factor,
so ``observe`` touches only the aggregate's entries), and max(priority) per slice is kept up to
date there (only the aggregated entries grow), by the backend's decaying vector on the host and
the device alike. The selection ranks by the score divided by the positive
constant lam / max(priority), |acc_i| * (stored_i + max(stored) / lam), the same order (up to
rounding) in three operations per entry instead of four. On the host the selection runs the
numpy way (``_scorer``, a block at a time through ``Selector.topk_scored``): the compiled score
(``select_kernels.top_k``, kind EMA, reading the priority only where |acc| times max(stored) +
floor could reach the threshold) was measured slower (``compiled_selection``). ``observe``'s
add and maxima run the numpy way too (``Decaying.add``): the compiled scatter that does both
(``add_compiled`` with ``tops``) was measured 6.4 against 6.8 ms at 1% but 1.46 against 1.10
at 0.1%.
"""

import numpy as np

from ..backends.device_engines import layout_bounds
from ..ops.select import radix
from ..ops.select.sparsify import select_kernels
from .base import Param, ScoredPolicy

STORED_LIMIT = 2.0 ** 40  # renormalise the stored priority before its maximum exceeds this


class EMA(ScoredPolicy):
    name = "ema"
    # select_kernels.top_k's EMA score, measured back to back against the numpy way at 11M:
    # 37-39 ms against 24-29 (its bound by max(stored) lets too few lines be skipped)
    compiled_selection = False
    params = {
        "beta": Param(float, 0.9, "EMA decay per round", lambda v: 0 <= v < 1, "in [0, 1)"),
        "lam": Param(float, 16.0, "weight of the shared priority", lambda v: v >= 0, ">= 0"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        # max(stored) per slice tracked beside it (priority.top), on the host or the device
        self.priority = self.backend.decaying(layout.numel, layout_bounds(layout))

    def device_key(self, accumulator):
        return radix.Key(radix.KEY_EMA, accumulator, aux=self.priority.stored, p0=self.lam,
                         pdev=self.priority.top)

    def _top(self, offset) -> float:
        """max(stored priority) in the slice at ``offset`` (a host-style path's read)."""
        return float(self.priority.top[self._slice_index(offset)])

    def score(self, acc, offset):
        """The documented score (the selection ranks a multiple of it)."""
        out = super().score(acc, offset)
        top = self._top(offset)
        if top > 0 and self.lam > 0:
            out *= np.float32(self.lam / top)
        return out

    def score_kind(self, acc, offset):
        """|acc| * (stored + floor), floor = max(stored) / lam; |acc| when there is no priority
        yet or lam = 0. The largest stored + floor bounds the factor (q)."""
        top = np.float32(self._top(offset))
        if top <= 0 or self.lam == 0:
            return (select_kernels.ABS,)
        floor = np.float32(float(top) / self.lam)
        stored = self.priority.stored[offset:offset + acc.size]
        return select_kernels.EMA, stored, None, floor, top + floor

    def _scorer(self, acc, offset):
        """A function writing score[sl] * max(stored) / lam into out (for the slice of ``acc``
        at ``offset``; |acc| when there is no priority yet or lam = 0)."""
        xp = self.xp
        stored = self.priority.stored[offset:offset + acc.size]
        top = self._top(offset)
        if top <= 0 or self.lam == 0:
            return lambda sl, out: xp.abs(acc[sl], out=out)
        floor = np.float32(top / self.lam)

        def score(sl, out):  # stored + floor > 0, so |acc * (it)| = |acc| * (it), no temporary
            xp.add(stored[sl], floor, out=out)
            out *= acc[sl]
            xp.abs(out, out=out)
        return score

    def observe(self, indices, values, iteration):
        # the maxima follow the decay's rescale and the add; the score multiplies |acc| by
        # about max(stored) * (1 + 1 / lam): renormalised before that nears float32's range
        self.priority.decay(self.beta, track_max=True)
        self.priority.add(indices, values, 1.0 - self.beta, track_max=True)
        self.priority.renormalise_above(STORED_LIMIT)

    def state_dict(self):
        return self.priority.state_dict()

    def load_state_dict(self, state):
        self.priority.load_state_dict(state)
        self.priority.refresh_maxima()
