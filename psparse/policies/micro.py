"""micro: exclusive partitions and a threshold steered by the compression-ratio error (MiCRO).

MiCRO (Yoon & Oh, HiPC 2023, arXiv 2310.00967; code github.com/kljp/micro,
``cnn-lstm/gradient_reducers.py``, ``MicroReducer``) cuts the flat gradient vector into L
contiguous partitions of equal size (numel // L, the first numel mod L one entry longer), one
per worker. At iteration t the worker at position p among the L live ranks owns partition
(t + p) mod L (the code rotates the assignment every step) and chooses every entry of that
partition with |acc| >= threshold. The partitions never overlap, so the workers' choices are
disjoint. Then, as in the code (an all-gather of the indices, an all-reduce of every worker's
values there), every worker sends its own accumulator at all the chosen indices: a two-phase
round here (``propose``: the worker's choice; the server keeps every proposal, ``group_k`` being
at least their total; ``select``: the group), so the aggregate is the mean of all workers'
accumulators at the union, and union = the sum of the choices, about k.

The threshold is the same on every worker: it starts at 1 / (2·sqrt(k)) and after each round is
multiplied by a factor chosen from the ratio r = (entries in the round's aggregate) / k:
``above`` (1.005) if r > ``band`` (1.1), ``within`` (1.00125) if r > 1/``band``, else ``below``
(0.995) (the code's constants; its in-band branch also names 0.9987, which cannot run: we use
what runs, 1.00125). The count is taken from the aggregate (its nonzero entries, so a dense
aggregate counts the same), identical bytes on every worker, where the code all-gathers the
workers' counts.

Assumed or changed, not in the code: a worker's proposal is capped at ``cap``·k/N entries (N
the run's world size; the server enforces the cap; over it the largest are proposed), where the
code pads every worker to the largest count; a worker with no entry over the threshold proposes
nothing (the code sends one entry, for its collective); after an
elastic loss the partitions are cut over the live ranks (the cap stays cap·k/N, the run's).
``--granularity layer`` is refused: the rule partitions the whole flat vector.

Density control (tests/test_partition_policies.py, docs/policies.md): on a steady gradient the
mean of union / k after the warm-up is within 10% of 1 (0.95: the in-band factor above 1 keeps
it near the band's lower edge); in training the gradient's scale falls faster than the
threshold's 0.5% a round and union / k lags below 1 (0.50 on mlp/digits after round 150), after
the threshold has risen from 1/(2·sqrt(k)), which sends up to the cap first (LeNet/MNIST, 8
workers, 1%: union / k 2.48 over 200 rounds). Host path only (``device_path = False``): the
threshold test is array code over the worker's partition and the controller reads the round's count
back, so a GPU worker refuses the policy by name (``--device cpu``) rather than synchronise with
the device every round. On the host the threshold test is threshold's compiled ``at_least`` (or
its numpy oracle where the kernels are off: the same indices).
"""

from __future__ import annotations

import math

import numpy as np

from .base import Param, PolicyError, SelectionPolicy


class Micro(SelectionPolicy):
    name = "micro"
    two_phase = True
    device_path = False  # numpy selection and a host threshold: refused on a GPU worker
    # propose reads the accumulator with array code, so on the GPU it must already hold this
    # round's gradient (no engine folds it in during the selection)
    fuses_accumulation = False
    params = {
        "cap": Param(float, 4.0, "a worker proposes at most cap x k / N entries (its largest)",
                     lambda v: v >= 1, ">= 1"),
        "init": Param(float, 0.0, "the first threshold (0: the papers' 1 / (2 sqrt(k)))",
                      lambda v: v >= 0, ">= 0"),
        "band": Param(float, 1.1, "union / k within [1/band, band] counts as on target",
                      lambda v: v > 1, "> 1"),
        "above": Param(float, 1.005, "threshold factor after a round with union > band x k",
                       lambda v: v >= 1, ">= 1"),
        "within": Param(float, 1.00125, "threshold factor after a round on target",
                        lambda v: v > 0, "> 0"),
        "below": Param(float, 0.995, "threshold factor after a round with union < k / band",
                       lambda v: 0 < v <= 1, "in (0, 1]"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        if layout.granularity != "model":
            raise PolicyError(f"policy {self.name!r} partitions the whole flat parameter vector "
                              "among the workers; it has no per-layer rule (use --granularity "
                              "model)")
        self.threshold = 0.0  # set at the first selection, from that round's k

    @property
    def max_propose(self) -> int:
        share = math.ceil(self.cap * self.k / self.world_size)
        return min(self.layout.numel, max(1, share))

    @property
    def group_k(self) -> int:
        """Every proposal is kept (they are disjoint): the server's vote is the union."""
        return min(self.layout.numel, self.world_size * self.max_propose)

    # --------------------------------------------------------------------- the partitions
    def edges(self) -> np.ndarray:
        """The L + 1 boundaries of the partitions over the live ranks (shared by all)."""
        count = len(self.live)
        q, r = divmod(self.layout.numel, count)
        j = np.arange(count + 1, dtype=np.int64)
        return j * q + np.minimum(j, r)

    def owned(self, iteration: int) -> int:
        """The partition this worker selects in at ``iteration``."""
        return (iteration + self.live.index(self.rank)) % len(self.live)

    # ---------------------------------------------------------------------- the round
    def propose(self, accumulator, iteration):
        if self.threshold == 0.0:
            self.threshold = self.init or 1.0 / (2.0 * math.sqrt(max(1, self.k)))
        edges = self.edges()
        j = self.owned(iteration)
        lo, hi = int(edges[j]), int(edges[j + 1])
        part = accumulator[lo:hi]
        chosen = self.engines.at_least(part, self.threshold)
        cap = self.max_propose
        if chosen.size > cap:  # the largest go; the rest waits in the accumulator
            chosen = chosen[self._largest(part[chosen], cap)]
        return chosen + lo

    def select(self, accumulator, iteration, group=None):
        if group is None:
            raise ValueError(f"{self.name} needs the group's indices (a two-phase round)")
        return self.xp.asarray(group, dtype=self.xp.int64)

    def _largest(self, values, count: int):
        """Sorted positions of the ``count`` largest |values| (ties to the lower position)."""
        return self.engines.largest(values, count)

    def observe(self, indices, values, iteration):
        self.steer(int(self.xp.count_nonzero(values)))

    def steer(self, sent: int) -> None:
        """The threshold after a round whose aggregate had ``sent`` entries."""
        ratio = sent / max(1, self.k)
        factor = (self.above if ratio > self.band else
                  self.within if ratio > 1.0 / self.band else self.below)
        self.threshold *= factor

    def state_dict(self) -> dict:
        return {"threshold": self.threshold}
