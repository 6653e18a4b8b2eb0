"""threshold: every entry with |accumulator| >= lam (hard-threshold sparsification).

Sahu et al. (NeurIPS 2021) show a fixed threshold with error feedback communicates less than
top-k for the same accuracy, because the number sent adapts to the gradient: k varies per
worker and per round, and ``--density`` is ignored (apart from sizing messages and ``cap``).

Its push cap (what the server enforces) is the whole model, or with ``cap=C`` C·k entries: when
more entries pass the threshold, the C·k of largest magnitude are sent and the rest stays in the
accumulator.
"""

import numpy as np

from .. import kernels, sparsify
from .base import Param, SelectionPolicy


class Threshold(SelectionPolicy):
    name = "threshold"
    params = {
        "lam": Param(float, 0.01, "send entries with |accumulator| >= lam",
                     lambda v: v > 0, "> 0"),
        "cap": Param(float, 0.0, "send at most cap x k entries, the largest (0: no cap)",
                     lambda v: v >= 0, ">= 0"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self._scratch = np.empty(min(sparsify.BLOCK, layout.numel), np.float32)

    @property
    def max_push(self):
        if self.cap == 0:
            return self.layout.numel
        return min(self.layout.numel, max(1, int(round(self.cap * self.k))))

    def select(self, accumulator, iteration, group=None):
        # on the host block by block: no model-sized |accumulator| or mask (kernels.at_least)
        chosen = kernels.at_least(accumulator, self.lam, self._scratch)
        if chosen.size > self.max_push:  # keep the largest: the rest waits in the accumulator
            chosen = self.per_slice(accumulator, self.layout.split(self.max_push), self.topk)
        return chosen
