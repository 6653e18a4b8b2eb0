"""frequency: among the c*k largest |accumulator| entries, send the k most often aggregated.

priority[i] = decayed count of rounds in which index i was in the aggregate:
    priority <- gamma * priority;  priority[aggregate indices] += 1
(identical on every worker, since it is built from the aggregate alone). Candidates are the
c*k entries of largest |accumulator|; of those, the k with the highest priority are sent,
ties broken by magnitude. Error feedback zeroes what was just sent, so recently aggregated
indices often drop out of the candidate pool: a larger c keeps them reachable.

Cost (issue 18, item 3): the counts decay lazily (``kernels.Decaying``: one scale factor, so
``observe`` touches only the aggregate's entries); the ranking reads the stored counts, which
order as the counts do.
"""

import numpy as np

from .. import kernels
from .base import Param, SelectionPolicy


class Frequency(SelectionPolicy):
    name = "frequency"
    params = {
        "c": Param(float, 4.0, "candidate pool size, as a multiple of k", lambda v: v >= 1,
                   ">= 1"),
        "gamma": Param(float, 0.9, "per-round decay of the counts", lambda v: 0 <= v < 1,
                       "in [0, 1)"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = kernels.Decaying(layout.numel, self.xp)

    def select_slice(self, acc, k, offset):
        pool = min(acc.size, int(np.ceil(self.c * k)))
        candidates = self.topk(acc, pool, offset)
        if pool <= k:
            return candidates
        xp = self.xp
        # highest priority first, then largest magnitude, then lowest index: the k largest of
        # one key (non-negative float32 bits order as the values do), by one partition
        key = self.priority.stored[offset + candidates].view(xp.uint32).astype(xp.uint64) << 32
        key |= xp.abs(acc[candidates]).view(xp.uint32)
        kth = xp.partition(key, pool - k)[pool - k]
        keep = key > kth
        short = k - int(xp.count_nonzero(keep))
        if short:  # ties in both: the lowest indices (candidates are sorted)
            keep[xp.flatnonzero(key == kth)[:short]] = True
        return candidates[keep]

    def observe(self, indices, values, iteration):
        self.priority.decay(self.gamma)
        self.priority.add(indices, None, 1.0)

    def state_dict(self):
        return self.priority.state_dict()

    def load_state_dict(self, state):
        self.priority.load_state_dict(state)
