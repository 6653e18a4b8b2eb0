"""The same loop as custom_loop.py with a selection policy of your own.

    psparse-launch --workers 4 --density 0.01 examples/custom_policy.py --epochs 2

A policy is one small class (docs/policies.md): here, top-k with a bonus for the indices that
were in any of the last few aggregates. Every worker sees the same aggregates, so every worker
gives the same indices the bonus and their selections overlap: the union, and with it the
server's broadcast (N x union), shrinks.
"""

from custom_loop import main

from psparse.policies import Param, SelectionPolicy


class RecentTopK(SelectionPolicy):
    name = "recent"
    params = {"bonus": Param(float, 2.0, "score factor for recently aggregated indices",
                             lambda v: v >= 1, ">= 1"),
              "window": Param(int, 5, "how many rounds an aggregated index stays recent",
                              lambda v: v >= 1, ">= 1")}

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        # the round each entry was last in the aggregate (shared: built from aggregates only)
        self.seen = self.xp.full(layout.numel, -10**9, dtype=self.xp.int64)
        self.round = 0

    def score(self, acc, offset):  # acc: one selection slice, starting at flat index offset
        recent = self.round - self.seen[offset:offset + acc.size] <= self.window
        return self.xp.abs(acc) * self.xp.where(recent, self.bonus, 1.0)

    def observe(self, indices, values, iteration):
        self.round = iteration + 1
        self.seen[indices] = iteration

    def state_dict(self):  # what a checkpoint must hold for an exact resume
        return {"seen": self.seen, "round": self.round}


if __name__ == "__main__":
    # found by module path, as on the command line: --policy custom_policy:RecentTopK
    main(policy="custom_policy:RecentTopK", policy_args={"bonus": 3, "window": 5})
