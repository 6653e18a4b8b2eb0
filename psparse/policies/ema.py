"""ema: blend each worker's |accumulator| with the group's recent aggregate magnitudes.

    priority <- beta * priority;  priority[i] += (1 - beta) * |aggregate_i|    (shared state)
    score_i   = |acc_i| * (1 + lam * priority_i / max(priority))

and the k largest scores are sent. An index the group has recently found large gets up to
(1 + lam) times the weight, so workers lean toward the same indices while a locally huge entry
still wins. (This is the blended-score variant; the candidate scheme is ``frequency``.)
"""

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

    def score(self, acc, offset):
        xp = self.xp
        prio = self.priority[offset:offset + acc.size]
        out = self._score[offset:offset + acc.size]
        top = float(prio.max()) if prio.size else 0.0
        if top <= 0:
            return xp.abs(acc, out=out)
        xp.multiply(prio, self.lam / top, out=out)
        out += 1.0
        out *= xp.abs(acc)
        return out

    def observe(self, indices, values, iteration):
        kernels.decay_and_add(self.priority, indices, values, self.beta, 1.0 - self.beta)

    def state_dict(self):
        return {"priority": self.priority}
