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

from ..cpu.sparsify import positions, select_kernels
from ..gpu import radix
from ..xp import to_host
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
        xp = self.xp
        self.previous = xp.empty(0, dtype=xp.int64)  # sorted indices of the last aggregate
        self._previous_host = np.empty(0, dtype=np.int64)  # the same, for searchsorted
        if self.dev is not None:  # on the device: a mask of the last aggregate's indices
            self.shared = xp.zeros(layout.numel, dtype=xp.uint8)
            return
        self._score = xp.empty(layout.numel, dtype=xp.float32)

    def device_key(self, accumulator):
        return radix.Key(radix.KEY_PENALTY, accumulator, mask=self.shared, p0=self.pi)

    def score_kind(self, acc, offset):
        """|acc| times pi, except at the slice's entries of the previous aggregate."""
        return select_kernels.PENALTY, None, self._shared(offset, acc.size), self.pi

    def _shared(self, offset, size):
        """The previous aggregate's entries in the slice [offset, offset + size), relative."""
        lo, hi = (int(i) for i in np.searchsorted(self._previous_host, [offset, offset + size]))
        return self.previous[lo:hi] - offset

    def _scorer(self, acc, offset):
        """A function writing score[sl] into out, for the slice of ``acc`` at ``offset``."""
        xp = self.xp
        shared = self._shared(offset, acc.size)

        def score(sl, out):
            xp.abs(acc[sl], out=out)
            out *= self.pi
            local = positions(shared, sl, acc.size)
            out[local] = xp.abs(acc[sl][local])  # undo the penalty where the group just sent
        return score

    def observe(self, indices, values, iteration):
        if self.dev is not None:
            self.shared[self.previous] = 0
            self.previous = indices.astype(self.xp.int64)  # a copy: the upload buffer is reused
            self.shared[self.previous] = 1
            return
        self._previous_host = np.array(to_host(indices), dtype=np.int64)
        self.previous = self.xp.asarray(self._previous_host)

    def state_dict(self):
        return {"previous": self.previous}  # on the host the same array as _previous_host

    def load_state_dict(self, state):
        previous = np.asarray(state["previous"], dtype=np.int64)
        self.observe(self.backend.upload("previous", previous), None, None)
