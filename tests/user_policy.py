"""A user-defined policy, loaded in the tests through --policy user_policy:LowestIndices."""

import numpy as np

from psparse.policies import Param, SelectionPolicy


class LowestIndices(SelectionPolicy):
    """Always the k lowest indices of each slice, every ``stride``-th one: all workers agree."""

    name = "lowest"
    params = {"stride": Param(int, 1, "distance between chosen indices", lambda v: v >= 1,
                              ">= 1")}

    def select_slice(self, acc, k, offset):
        return np.arange(k, dtype=np.int64) * self.stride
