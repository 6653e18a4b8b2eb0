"""Straightforward versions of the built-in policies: what each selects, written the plain way.

These are the policies as they were before their selection was made fast (issue 18, item 3),
with top-k done by ``selection.topk_reference`` (a full lexsort) and state updates as dense numpy
expressions. ``tests/test_policy_equivalence.py`` runs every built-in policy against its
reference over many rounds and asserts the same indices and the same state. numpy only.
"""

from __future__ import annotations

import numpy as np

from psparse.ops.select.selection import topk_reference
from psparse.policies import REGISTRY as BUILT_IN
from psparse.policies import SelectionPolicy


class Reference(SelectionPolicy):
    def topk(self, score, k, offset=0):
        return topk_reference(score, k)


def decay_and_add(priority, indices, values, decay, weight, magnitude=True):
    priority *= np.float32(decay)
    if indices.size:
        priority[indices] += np.float32(weight) * (np.abs(values) if magnitude else values)


class TopK(Reference):
    name = "topk"


class RandomK(Reference):
    name = "randomk"

    def select(self, accumulator, iteration, group=None):
        parts = []
        for (offset, size), k in zip(self.layout.slices, self.slice_k):
            rng = np.random.default_rng([self.seed, iteration, offset])
            parts.append(np.sort(rng.choice(size, size=k, replace=False)) + offset)
        return np.concatenate(parts).astype(np.int64)


class Threshold(Reference):
    name = "threshold"
    params = BUILT_IN["threshold"].params
    max_push = BUILT_IN["threshold"].max_push

    def select(self, accumulator, iteration, group=None):
        # per slice: the entries at or above lam; more than the slice's share of the cap: the
        # share's largest
        parts = []
        for (offset, size), share in zip(self.layout.slices, self.layout.split(self.max_push)):
            acc = accumulator[offset:offset + size]
            chosen = np.flatnonzero(np.abs(acc) >= self.lam)
            if chosen.size > share:
                chosen = self.topk(acc, share)
            parts.append(chosen + offset)
        return np.concatenate(parts).astype(np.int64)


class Frequency(Reference):
    name = "frequency"
    params = BUILT_IN["frequency"].params

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = np.zeros(layout.numel, dtype=np.float32)

    def select_slice(self, acc, k, offset):
        pool = min(acc.size, int(np.ceil(self.c * k)))
        candidates = self.topk(acc, pool, offset)
        prio = self.priority[offset + candidates]
        order = np.lexsort(np.stack([-np.abs(acc[candidates]), -prio]))
        return np.sort(candidates[order[:k]])

    def observe(self, indices, values, iteration):
        self.priority *= np.float32(self.gamma)
        self.priority[indices] += np.float32(1.0)

    def state_dict(self):
        return {"priority": self.priority}


class EMA(Reference):
    name = "ema"
    params = BUILT_IN["ema"].params

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = np.zeros(layout.numel, dtype=np.float32)

    def score(self, acc, offset):
        prio = self.priority[offset:offset + acc.size]
        top = float(prio.max()) if prio.size else 0.0
        if top <= 0:
            return np.abs(acc)
        out = prio * np.float32(self.lam / top)  # float32 x a Python float: float32, as before
        out += 1.0
        out *= np.abs(acc)
        return out

    def observe(self, indices, values, iteration):
        decay_and_add(self.priority, indices, values, self.beta, 1.0 - self.beta)

    def state_dict(self):
        return {"priority": self.priority}


class Penalty(Reference):
    name = "penalty"
    params = BUILT_IN["penalty"].params

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.previous = np.empty(0, dtype=np.int64)

    def score(self, acc, offset):
        out = np.abs(acc) * np.float32(self.pi)
        lo, hi = np.searchsorted(self.previous, [offset, offset + acc.size])
        shared = self.previous[lo:hi] - offset
        out[shared] = np.abs(acc[shared])
        return out

    def observe(self, indices, values, iteration):
        self.previous = np.array(indices, dtype=np.int64)

    def state_dict(self):
        return {"previous": self.previous}


class CyclicLocalTopK(Reference):
    name = "cltk"
    two_phase = True

    def propose(self, accumulator, iteration):
        if self.live[iteration % len(self.live)] != self.rank:
            return None
        return self.per_slice(accumulator, self.slice_k, self.topk)

    def select(self, accumulator, iteration, group=None):
        return np.asarray(group, dtype=np.int64)


class SharedCore(Reference):
    name = "core"
    params = BUILT_IN["core"].params

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = np.zeros(layout.numel, dtype=np.float32)

    def select_slice(self, acc, k, offset):
        prio = self.priority[offset:offset + acc.size]
        if self.signed:
            prio = np.abs(prio)
        core_k = min(k - int(round(self.own * k)), int(np.count_nonzero(prio)))
        core = self.topk(prio, core_k) if core_k > 0 else np.empty(0, np.int64)
        # the core, and the k - |core| largest |acc| outside it (zeros included)
        mag = np.abs(acc).astype(np.float64)
        mag[core] = np.inf
        return self.topk(mag, k)

    def observe(self, indices, values, iteration):
        decay_and_add(self.priority, indices, values, self.beta, 1.0 - self.beta,
                      magnitude=not self.signed)

    def state_dict(self):
        return {"priority": self.priority}


class PushesTheGroup(Reference):
    """A two-phase rule whose push is the group's indices (vote, micro, exdyna)."""

    two_phase = True

    def select(self, accumulator, iteration, group=None):
        return np.asarray(group, dtype=np.int64)


class Vote(PushesTheGroup):
    name = "vote"
    params = BUILT_IN["vote"].params
    max_propose = BUILT_IN["vote"].max_propose
    group_k = BUILT_IN["vote"].group_k

    def propose(self, accumulator, iteration):
        return self.per_slice(accumulator, self.layout.split(self.max_propose), self.topk)


class Micro(PushesTheGroup):
    name = "micro"
    params = BUILT_IN["micro"].params
    max_propose = BUILT_IN["micro"].max_propose
    group_k = BUILT_IN["micro"].group_k
    threshold = 0.0

    def edges(self):
        n, count = self.layout.numel, len(self.live)
        return np.cumsum([0] + [n // count + (j < n % count) for j in range(count)])

    def propose(self, accumulator, iteration):
        if self.threshold == 0.0:
            self.threshold = self.init or 1.0 / (2.0 * float(np.sqrt(max(1, self.k))))
        edges = self.edges()
        mine = (iteration + self.live.index(self.rank)) % len(self.live)
        part = accumulator[edges[mine]:edges[mine + 1]]
        chosen = np.flatnonzero(np.abs(part) >= self.threshold)
        if chosen.size > self.max_propose:
            chosen = chosen[self.topk(part[chosen], self.max_propose)]
        return (chosen + edges[mine]).astype(np.int64)

    def observe(self, indices, values, iteration):
        ratio = np.count_nonzero(values) / max(1, self.k)
        if ratio > self.band:
            self.threshold *= self.above
        elif ratio > 1.0 / self.band:
            self.threshold *= self.within
        else:
            self.threshold *= self.below

    def state_dict(self):
        return {"threshold": self.threshold}


class ExDyna(Micro):
    name = "exdyna"
    params = BUILT_IN["exdyna"].params
    parts = None

    def cut(self):
        n = self.layout.numel
        size = n // self.blocks
        if size >= self.align:
            size = size // self.align * self.align
        if self.parts is None:
            q, r = divmod(self.blocks, self.world_size)
            self.parts = [q + 1 if j < r else q for j in range(self.world_size)]
        edges = [0]
        for blocks in self.parts:
            edges.append(edges[-1] + blocks * size)
        edges[-1] = n  # the leftover is the last partition's
        return np.array(edges), size

    def edges(self):
        return self.cut()[0]

    def observe(self, indices, values, iteration):
        edges, size = self.cut()
        kept = indices[values != 0]
        counts = [int(np.sum((kept >= lo) & (kept < hi))) for lo, hi in zip(edges, edges[1:])]
        total, n = sum(counts), len(counts)
        if total // n > 0:
            mean, shift = int(total / n), int(size * total / self.layout.numel)
            for i in range(n - 1):
                a, b = counts[i] / mean, counts[i + 1] / mean
                give = i if (a > self.balance and b < 1 / self.balance) else \
                    i + 1 if (a < 1 / self.balance and b > self.balance) else None
                if give is None or self.parts[give] - 1 < self.blocks / (self.floor * n):
                    continue
                take = 2 * i + 1 - give
                self.parts[give] -= 1
                self.parts[take] += 1
                counts[give] -= shift
                counts[take] += shift
        super().observe(indices, values, iteration)

    def state_dict(self):
        self.cut()
        return {"threshold": self.threshold, "parts": np.array(self.parts, np.int64)}

    def load_state_dict(self, state):
        self.threshold = float(state["threshold"])
        self.parts = [int(b) for b in state["parts"]]


REFERENCES = {cls.name: cls for cls in (TopK, RandomK, Threshold, Frequency, EMA, Penalty,
                                        CyclicLocalTopK, SharedCore, Vote, Micro, ExDyna)}
