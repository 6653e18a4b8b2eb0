"""penalty: entries absent from the previous aggregate have their |accumulator| scaled by pi.

    score_i = |acc_i|        if i was in the previous round's aggregate
              pi * |acc_i|   otherwise                     (0 < pi <= 1)

so a new index must be 1/pi times larger than a shared one to displace it. The previous
aggregate is identical on every worker, so all workers favour the same indices.

Cost (issue 18, item 3): on the host the compiled selection (``select_kernels.top_k``, kind
PENALTY) collects every |acc| that could reach the sampled threshold off the shared entries
(t / pi), one vector compare a cache line as top-k's pass, and merges the shared entries in
afterwards, each looked up once; where the compiled kernels are off, the numpy way makes the
score a block at a time (``Selector.topk_scored``), each block's shared entries restored
while it is in cache. The same indices either way.
"""

import numpy as np

from ..ops.select import radix
from ..ops.select.sparsify import positions, select_kernels
from .base import Param, ScoredPolicy


class Penalty(ScoredPolicy):
    name = "penalty"
    # select_kernels.top_k's PENALTY candidates, measured back to back against the numpy way
    # (bench_select's rounds, whole round with the accumulator's update): 11M at 0.1% / 1%
    # 26.0 / 41.9 ms against 35.9 / 49.9 (top-k 27.4 / 35.3); 61,706: 0.10 / 0.22 against
    # 0.25 / 0.30 ms. (The first compiled score searched the shared entries in every line
    # it read, with the threshold itself as the bound: 2-3x slower than numpy.)
    compiled_selection = True
    params = {
        "pi": Param(float, 0.25, "factor for indices absent from the previous aggregate",
                    lambda v: 0 < v <= 1, "in (0, 1]"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        # the last aggregate's indices: sorted on the host, a byte mask on the device
        self.previous = self.backend.index_set(layout.numel)

    def device_key(self, accumulator):
        return radix.Key(radix.KEY_PENALTY, accumulator, mask=self.previous.mask, p0=self.pi)

    def score_kind(self, acc, offset):
        """|acc| times pi, except at the slice's entries of the previous aggregate."""
        return select_kernels.PENALTY, None, self.previous.within(offset, acc.size), self.pi

    def _scorer(self, acc, offset):
        """A function writing score[sl] into out, for the slice of ``acc`` at ``offset``."""
        xp = self.xp
        shared = self.previous.within(offset, acc.size)

        def score(sl, out):
            xp.abs(acc[sl], out=out)
            out *= self.pi
            local = positions(shared, sl, acc.size)
            out[local] = xp.abs(acc[sl][local])  # undo the penalty where the group just sent
        return score

    def observe(self, indices, values, iteration):
        self.previous.replace(indices)

    def state_dict(self):
        return {"previous": self.previous.indices}

    def load_state_dict(self, state):
        previous = np.asarray(state["previous"], dtype=np.int64)
        self.previous.replace(self.backend.upload("previous", previous))
