"""vote: the group keeps the indices that are large across workers (a global top-k estimate).

A two-phase round. Every worker proposes its top ``offer * k`` entries (indices and its
accumulator values there); the server keeps the ``keep * k`` proposed indices of largest mean
|value| over all workers (an index proposed by many workers, or hugely by one, wins), and every
worker pushes its accumulator at exactly those indices. So the aggregate is the true mean of all
workers' residuals at the kept indices, and union / k = keep.

This follows gTop-k (Shi et al. 2019), which selects the global top-k of the summed sparse
vectors; here the selection happens at the server from the proposals, so the broadcast is
``keep * k`` indices plus the aggregate, instead of the union of everyone's top-k.
"""

from ..ops.select import radix
from .base import Param, SelectionPolicy


class Vote(SelectionPolicy):
    name = "vote"
    two_phase = True
    params = {
        "keep": Param(float, 1.0, "indices the group keeps, as a multiple of k",
                      lambda v: v > 0, "> 0"),
        "offer": Param(float, 1.0, "entries each worker proposes, as a multiple of k",
                         lambda v: v > 0, "> 0"),
    }

    def propose(self, accumulator, iteration):
        shares = self.layout.split(self.max_propose)
        # the proposal (on a device with its values), the accumulator untouched
        return self.engines.select("propose", radix.Key(radix.KEY_ABS, accumulator),
                                   shares, self.fusion, final=False)

    @property
    def max_propose(self):
        return min(self.layout.numel, int(round(self.offer * self.k)))

    @property
    def group_k(self):
        return max(1, int(round(self.keep * self.k)))

    def select(self, accumulator, iteration, group=None):
        if group is None:
            raise ValueError("vote needs the group's indices (a two-phase round)")
        return self.xp.asarray(group, dtype=self.xp.int64)
