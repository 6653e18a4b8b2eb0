"""randomk: k uniformly random indices drawn from a seed every worker shares.

All workers draw the same indices in a round (union = k exactly) without exchanging anything:
the draw depends only on (seed, iteration, slice). The values sent are each worker's
accumulator there, so error feedback still carries the rest.
"""

import numpy as np

from .base import SelectionPolicy


class RandomK(SelectionPolicy):
    name = "randomk"
    fuses_accumulation = False  # it never reads the accumulator

    def select(self, accumulator, iteration, group=None):
        parts = []
        for (offset, size), k in zip(self.layout.slices, self.slice_k):
            rng = np.random.default_rng([self.seed, iteration, offset])
            parts.append(np.sort(rng.choice(size, size=k, replace=False)) + offset)
        chosen = np.concatenate(parts).astype(np.int64)
        return self.backend.upload("randomk", chosen)  # drawn on the host: on a device, one
        #                                                 asynchronous upload
