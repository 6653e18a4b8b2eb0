"""penalty: entries absent from the previous aggregate have their |accumulator| scaled by pi.

    score_i = |acc_i|        if i was in the previous round's aggregate
              pi * |acc_i|   otherwise                     (0 < pi <= 1)

so a new index must be 1/pi times larger than a shared one to displace it. The previous
aggregate is identical on every worker, so all workers favour the same indices.

Cost (issue 18, item 3): the factor (1 or pi) is kept per entry, updated at the old and new
aggregate's indices only, so the score is one multiply (|acc| * 1 is |acc| exactly); on large
slices it is made and selected a block at a time (``Selector.topk_scored``).
"""

import numpy as np

from ..xp import to_host
from .base import Param, SelectionPolicy


class Penalty(SelectionPolicy):
    name = "penalty"
    params = {
        "pi": Param(float, 0.25, "factor for indices absent from the previous aggregate",
                    lambda v: 0 < v <= 1, "in (0, 1]"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        xp = self.xp
        self.previous = xp.empty(0, dtype=xp.int64)  # sorted indices of the last aggregate
        self._previous_host = np.empty(0, dtype=np.int64)  # the same, for the state
        self._factor = xp.full(layout.numel, self.pi, dtype=xp.float32)  # 1 at previous
        self._score = xp.empty(layout.numel, dtype=xp.float32)

    def select_slice(self, acc, k, offset):
        return self.topk_scored(self._scorer(acc, offset), k, offset,
                                self._score[offset:offset + acc.size])

    def score(self, acc, offset):
        out = self._score[offset:offset + acc.size]
        self._scorer(acc, offset)(slice(0, acc.size), out)
        return out

    def _scorer(self, acc, offset):
        xp, factor = self.xp, self._factor[offset:offset + acc.size]

        def score(sl, out):
            xp.abs(acc[sl], out=out)
            out *= factor[sl]
        return score

    def observe(self, indices, values, iteration):
        self._factor[self.previous] = self.pi
        self._previous_host = np.array(to_host(indices), dtype=np.int64)
        self.previous = self.xp.asarray(self._previous_host)
        self._factor[self.previous] = 1.0

    def state_dict(self):
        return {"previous": self._previous_host}

    def load_state_dict(self, state):
        self.observe(np.asarray(state["previous"]), None, None)
