"""exdyna: MiCRO's exclusive selection over block partitions that rebalance (ExDyna).

ExDyna (Yoon & Oh, CCGrid 2024, arXiv 2402.13781, "Preserving Near-Optimal Gradient
Sparsification Cost for Scalable Distributed Deep Learning"; code github.com/kljp/exdyna,
``cnn-lstm/gradient_reducers.py``, ``ExDynaReducer``) cuts the flat vector into ``blocks``
(1024) blocks of numel // blocks entries, rounded down to a multiple of ``align`` (32; here only
when that leaves at least ``align``: smaller models keep numel // blocks); the entries left
over belong to the last partition. (On a small model the rounding leaves much over: LeNet-5's
61,706 entries give blocks of 32 and 28,938 entries, 47%, to the last partition; ``align=1``
keeps the leftover under ``blocks``.) A partition is a run of contiguous blocks; at first the blocks are shared
equally (blocks // L each, the first blocks mod L one more). The assignment rotates as in
``micro`` (partition (t + p) mod L for the worker at position p among the L live ranks) and the
threshold and the two-phase round (every worker pushes its accumulator at the union of the
choices) are micro's, with the same constants.

Rebalancing, every round, from the counts of the round just done per partition: with m =
int(union / L) (no rebalancing when m = 0) and d = union / numel, for each neighbouring pair
(i, i + 1) from left to right: if count_i / m > ``balance`` (1.05) and count_i+1 / m < 1 /
``balance``, one block moves from partition i to i + 1, and the other way round when the
ratios are reversed; a partition never goes below blocks / (``floor``·L) blocks (``floor`` 4);
after a move the two counts are corrected by int(block size · d) before the next pair is
compared. The code reads the counts from its all-gather of the workers' counts; here they are
the aggregate's nonzero entries per partition, identical bytes on every worker, so the
boundaries are the same everywhere (and in ``state_dict``, for ``--resume``).

Assumed, beyond the code: what ``micro`` assumes (the push cap, empty pushes, layer
granularity refused); after an elastic loss the blocks are shared equally among the live ranks
again, and the round of the loss does not rebalance (its counts are of the old partitions).
"""

from __future__ import annotations

import numpy as np

from .base import Param, PolicyError
from .micro import Micro


class ExDyna(Micro):
    name = "exdyna"
    params = {
        **Micro.params,
        "blocks": Param(int, 1024, "blocks the flat vector is cut into", lambda v: v >= 1,
                        ">= 1"),
        "align": Param(int, 32, "block size rounded down to a multiple of align (1: none)",
                       lambda v: v >= 1, ">= 1"),
        "balance": Param(float, 1.05, "a neighbour pair rebalances when one count is above "
                         "balance x the mean and the other below mean / balance",
                         lambda v: v > 1, "> 1"),
        "floor": Param(float, 4.0, "a partition keeps at least blocks / (floor x N) blocks",
                       lambda v: v >= 1, ">= 1"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        numel = layout.numel
        if self.blocks > numel or self.blocks < self.world_size:
            raise PolicyError(f"policy 'exdyna': blocks={self.blocks} must be at least the "
                              f"world size ({self.world_size}) and at most the model's "
                              f"{numel} entries")
        size = numel // self.blocks
        self.block_size = size - size % self.align if size >= self.align else size
        self.leftover = numel - self.block_size * self.blocks  # the last partition's
        self.parts = self.equal_parts()

    def equal_parts(self) -> np.ndarray:
        """The first cut: blocks shared equally among the live ranks."""
        q, r = divmod(self.blocks, len(self.live))
        return np.array([q + (j < r) for j in range(len(self.live))], dtype=np.int64)

    def edges(self) -> np.ndarray:
        if self.parts.size != len(self.live):  # an elastic loss: cut again over the live ranks
            self.parts = self.equal_parts()
        edges = np.concatenate([[0], np.cumsum(self.parts)]) * self.block_size
        edges[-1] += self.leftover
        return edges

    def observe(self, indices, values, iteration):
        xp = self.xp
        sent = indices[values != 0]
        if self.parts.size == len(self.live):
            edges = xp.asarray(self.edges())
            # the aggregate's indices are sorted: partition p holds those in [edges[p],
            # edges[p + 1]) (no bincount: on CuPy it sizes its result from the data, a wait)
            counts = self.host(xp.diff(xp.searchsorted(sent, edges)))
            self.rebalance(counts.astype(np.int64))
        self.steer(int(sent.size))

    def rebalance(self, counts: np.ndarray) -> None:
        """Move single blocks between neighbouring partitions whose counts are unbalanced."""
        total = int(counts.sum())
        mean = int(total / counts.size)
        if mean == 0:
            return
        moved = int(self.block_size * (total / self.layout.numel))
        least = self.blocks / (self.floor * counts.size)
        high, low = self.balance, 1.0 / self.balance
        for i in range(counts.size - 1):  # a loop over partitions, not entries
            left, right = counts[i] / mean, counts[i + 1] / mean
            if left > high and right < low:
                donor, taker = i, i + 1
            elif left < low and right > high:
                donor, taker = i + 1, i
            else:
                continue
            if self.parts[donor] - 1 < least:
                continue
            self.parts[donor] -= 1
            self.parts[taker] += 1
            counts[donor] -= moved
            counts[taker] += moved

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "parts": self.parts}

    def load_state_dict(self, state: dict) -> None:
        self.threshold = float(state["threshold"])
        self.parts = np.array(state["parts"], dtype=np.int64)  # its length: the live ranks
