"""threshold: every entry with |accumulator| >= lam (hard-threshold sparsification).

Sahu et al. (NeurIPS 2021) show a fixed threshold with error feedback communicates less than
top-k for the same accuracy, because the number sent adapts to the gradient: k varies per
worker and per round, and ``--density`` is ignored (apart from sizing messages).
"""

from .base import Param, SelectionPolicy


class Threshold(SelectionPolicy):
    name = "threshold"
    params = {
        "lam": Param(float, 0.01, "send entries with |accumulator| >= lam",
                     lambda v: v > 0, "> 0"),
    }

    def select(self, accumulator, iteration, group=None):
        xp = self.xp
        return xp.flatnonzero(xp.abs(accumulator) >= self.lam)
