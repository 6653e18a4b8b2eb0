"""User policies that break the rules on purpose, loaded by tests/test_policy_output.py through
--policy faulty_policy:Faulty (the worker must refuse their output before sending anything)."""

import numpy as np

from psparse.policies import Param, PolicyError, SelectionPolicy

FAULTS = ("none", "double", "half", "float", "out_of_range", "negative", "unsorted", "raise")


class Faulty(SelectionPolicy):
    """Plain top-k until iteration ``at``; from then on, on rank ``on_rank`` (-1: every rank),
    returns the kind of index set named by ``fault``."""

    name = "faulty"
    params = {
        "fault": Param(str, "none", "what to get wrong", lambda v: v in FAULTS,
                       f"one of {', '.join(FAULTS)}"),
        "at": Param(int, 0, "first iteration with the fault", lambda v: v >= 0, ">= 0"),
        "on_rank": Param(int, -1, "the rank that misbehaves (-1: all)", lambda v: v >= -1,
                         ">= -1"),
    }

    def select(self, accumulator, iteration, group=None):
        top = super().select(accumulator, iteration)
        if iteration < self.at or self.on_rank not in (-1, self.rank):
            return top
        numel = self.layout.numel
        if self.fault == "double":  # 2k indices: over the budget
            return np.arange(min(numel, 2 * self.k), dtype=np.int64)
        if self.fault == "half":  # k/2 indices: allowed, counted
            return top[: self.k // 2]
        if self.fault == "float":
            return top.astype(np.float64)
        if self.fault == "out_of_range":
            return np.append(top[:-1], numel)
        if self.fault == "negative":
            return np.concatenate([[-1], top[1:]])
        if self.fault == "unsorted":
            return top[::-1].copy()
        if self.fault == "raise":
            raise RuntimeError(f"this policy broke at iteration {iteration}")
        return top


class NeedsManyEntries(SelectionPolicy):
    """Valid only on a real model: refuses layouts under 1,000 entries or k below 2 (the old
    launcher check built every policy on a 1-entry layout with k = 1)."""

    name = "needs-many"

    def __init__(self, layout, k, **kw):
        if layout.numel < 1000 or k < 2:
            raise PolicyError(f"needs-many: numel {layout.numel} and k {k} are too small")
        super().__init__(layout, k, **kw)
