"""cltk: cyclic local top-k (ScaleCom, Chen et al. NeurIPS 2020).

At iteration t the leader, the (t mod L)-th of the L live ranks (rank t mod N while no worker
was lost from an elastic run), proposes the top-k of its own accumulator; every worker
pushes its own accumulator values at exactly those indices, so the union is k. This needs the
leader's indices before the push: a two-phase round (proposals, then pushes), which costs one
extra index broadcast per round, counted in the metrics.
"""

from ..ops.select import radix
from .base import SelectionPolicy


class CyclicLocalTopK(SelectionPolicy):
    name = "cltk"
    two_phase = True

    def propose(self, accumulator, iteration):
        if self.live[iteration % len(self.live)] != self.rank:
            return None
        # the proposal (on a device with its values), the accumulator untouched
        return self.engines.select("propose", radix.Key(radix.KEY_ABS, accumulator),
                                   self.slice_k, self.fusion, final=False)

    def select(self, accumulator, iteration, group=None):
        if group is None:
            raise ValueError("cltk needs the group's indices (a two-phase round)")
        return self.xp.asarray(group, dtype=self.xp.int64)
