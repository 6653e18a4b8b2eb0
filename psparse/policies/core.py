"""core: a shared core of indices chosen from the aggregate history, plus a small own slice.

Shared state (identical on every worker, built from the aggregates):
    priority <- beta * priority;  priority[i] += (1 - beta) * |aggregate_i|
(with ``signed=true``: the EMA of the signed aggregate, ranked by its magnitude)

Each round, per slice, with budget k:
    core = the (1 - own) * k indices of highest priority (only indices with priority > 0)
    mine = the remaining budget from this worker's largest |accumulator| outside the core
Every worker sends the same core, so the union is |core| + at most N * own * k:
union / k <= (1 - own) + N * own  (1.875 for N = 8, own = 0.125).

Why it keeps accuracy: the own slice lets each worker push what is large for it; once the group
has seen an index large in the aggregate, it enters everyone's core for a while (gradient
magnitude is concentrated on few indices over short periods), and error feedback carries every
entry not yet sent, so nothing is dropped.
"""

from .. import kernels
from .base import Param, SelectionPolicy


class SharedCore(SelectionPolicy):
    name = "core"
    params = {
        "own": Param(float, 0.125, "fraction of k each worker picks from its own top entries",
                     lambda v: 0 <= v <= 1, "in [0, 1]"),
        "beta": Param(float, 0.5, "EMA decay of the shared priority", lambda v: 0 <= v < 1,
                      "in [0, 1)"),
        "signed": Param(bool, False, "rank the core by |EMA of the signed aggregate| (noise "
                        "that flips sign cancels) instead of the EMA of |aggregate|"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = self.xp.zeros(layout.numel, dtype=self.xp.float32)
        self._mag = self.xp.empty(layout.numel, dtype=self.xp.float32)

    def select_slice(self, acc, k, offset):
        xp = self.xp
        prio = self.priority[offset:offset + acc.size]
        if self.signed:
            prio = xp.abs(prio)
        core_k = min(k - int(round(self.own * k)), int(xp.count_nonzero(prio)))
        core = self.topk(prio, core_k, offset) if core_k > 0 else xp.empty(0, xp.int64)
        mag = xp.abs(acc, out=self._mag[offset:offset + acc.size])
        mag[core] = 0.0  # the core is sent anyway: spend the own budget elsewhere
        mine = self.topk(mag, k - core.size, offset)
        return kernels.sorted_union([core, mine])

    def observe(self, indices, values, iteration):
        kernels.decay_and_add(self.priority, indices, values, self.beta, 1.0 - self.beta,
                              magnitude=not self.signed)

    def state_dict(self):
        return {"priority": self.priority}
