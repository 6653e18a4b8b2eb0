"""ema: blend each worker's |accumulator| with the group's recent aggregate magnitudes.

    priority <- beta * priority;  priority[i] += (1 - beta) * |aggregate_i|    (shared state)
    score_i   = |acc_i| * (1 + lam * priority_i / max(priority))

and the k largest scores are sent. An index the group has recently found large gets up to
(1 + lam) times the weight, so workers lean toward the same indices while a locally huge entry
still wins. (This is the blended-score variant; the candidate scheme is ``frequency``.)

Cost (issue 18, item 3): max(priority) is kept up to date in ``observe`` (a decayed maximum is
the maximum decayed, exactly, and only the aggregated entries grow), and on large slices the
score is made and selected a block at a time (``Selector.topk_scored``), so a round reads the
accumulator and the priority once and writes no model-sized array.
"""

import numpy as np

from .. import kernels
from .base import Param, SelectionPolicy


class EMA(SelectionPolicy):
    name = "ema"
    params = {
        "beta": Param(float, 0.9, "EMA decay per round", lambda v: 0 <= v < 1, "in [0, 1)"),
        "lam": Param(float, 16.0, "weight of the shared priority", lambda v: v >= 0, ">= 0"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = self.xp.zeros(layout.numel, dtype=self.xp.float32)
        self._score = self.xp.empty(layout.numel, dtype=self.xp.float32)
        self._top = [np.float32(0)] * len(layout.slices)  # max(priority) per slice

    def select_slice(self, acc, k, offset):
        return self.topk_scored(self._scorer(acc, offset), k, offset,
                                self._score[offset:offset + acc.size])

    def score(self, acc, offset):
        out = self._score[offset:offset + acc.size]
        self._scorer(acc, offset)(slice(0, acc.size), out)
        return out

    def _scorer(self, acc, offset):
        """A function writing score[sl] into out, for the slice of ``acc`` at ``offset``."""
        xp = self.xp
        prio = self.priority[offset:offset + acc.size]
        top = float(self._top[self._slice_index(offset)])

        def score(sl, out):
            if top <= 0:
                xp.abs(acc[sl], out=out)
                return
            xp.multiply(prio[sl], self.lam / top, out=out)
            out += 1.0
            out *= xp.abs(acc[sl])
        return score

    def observe(self, indices, values, iteration):
        updated = self.xp.empty(indices.size, dtype=self.xp.float32)  # priority[indices]
        kernels.decay_and_add(self.priority, indices, values, self.beta, 1.0 - self.beta,
                              out=updated)
        beta = np.float32(self.beta)
        for s, (lo, hi) in enumerate(kernels.slice_bounds(indices, self.layout.slices)):
            top = self._top[s] * beta  # the decayed maximum, rounded as the entries were
            if hi > lo:
                top = max(top, np.float32(float(updated[lo:hi].max())))
            self._top[s] = top

    def state_dict(self):
        return {"priority": self.priority}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._top = [np.float32(float(self.priority[o:o + n].max())) if n else np.float32(0)
                     for o, n in self.layout.slices]
