"""penalty: entries absent from the previous aggregate have their |accumulator| scaled by pi.

    score_i = |acc_i|        if i was in the previous round's aggregate
              pi * |acc_i|   otherwise                     (0 < pi <= 1)

so a new index must be 1/pi times larger than a shared one to displace it. The previous
aggregate is identical on every worker, so all workers favour the same indices.
"""

import numpy as np

from .base import Param, SelectionPolicy


class Penalty(SelectionPolicy):
    name = "penalty"
    params = {
        "pi": Param(float, 0.25, "factor for indices absent from the previous aggregate",
                    lambda v: 0 < v <= 1, "in (0, 1]"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.previous = np.empty(0, dtype=np.int64)  # sorted indices of the last aggregate
        self._score = np.empty(layout.numel, dtype=np.float32)

    def score(self, acc, offset):
        out = self._score[offset:offset + acc.size]
        np.abs(acc, out=out)
        out *= self.pi
        lo, hi = np.searchsorted(self.previous, [offset, offset + acc.size])
        shared = self.previous[lo:hi] - offset
        out[shared] = np.abs(acc[shared])  # undo the penalty where the group just sent
        return out

    def observe(self, indices, values, iteration):
        self.previous = np.array(indices, dtype=np.int64)

    def state_dict(self):
        return {"previous": self.previous}

    def load_state_dict(self, state):
        self.previous = np.array(state["previous"], dtype=np.int64)
