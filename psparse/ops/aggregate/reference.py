"""The server's round arithmetic in numpy: the compiled kernels' reference and test oracle.

Each hot step of the server's round as it was written before the kernels
(``agg_kernels.py`` beside this file), kept verbatim in behaviour. They are the kernels' test
oracle (tests/test_cpu_kernels.py holds every kernel to its reference, bit for bit) and nowhere
on a large round's path: the package runs them when ``PSPARSE_CPU_KERNELS=numpy`` asks for them
(psparse/ops/jit.py), to check a whole run against the reference, and for small calls in a
process that has not loaded numba (jit.SMALL; tests/test_small_calls.py). Each function says
which kernel it is the reference of. One deliberate difference, at the edge of the number
range: ``sparsify.topk_exact`` (the vote's and the size limit's top-k here) refuses values whose
float32 sum overflows, even when every value is finite, where ``aggregation.top_k`` refuses only
a NaN or inf value.
"""

from __future__ import annotations

import numpy as np

from ..select.sparsify import topk_exact


def sorted_union(indices: list) -> np.ndarray:
    """Sorted distinct values of several index arrays (sort, then drop repeats)."""
    merged = np.concatenate(indices)
    if len(indices) == 2:
        merged.sort(kind="stable")
    else:
        merged = np.sort(merged)
    if merged.size < 2:
        return merged
    keep = np.empty(merged.size, dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]


def sparse_mean(accumulator: np.ndarray, indices: list, values: list):
    """(sorted union, mean there) of N pushes summed in list order into the zeroed dense
    ``accumulator`` (left zeroed). Reference of agg_kernels.sparse_sum + divide / dense_sum."""
    if not indices:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    for idx, val in zip(indices, values):
        np.add.at(accumulator, idx, val)
    union = sorted_union(indices)
    mean = accumulator[union] / np.float32(len(values))
    accumulator[union] = 0.0
    return union, mean


def candidates(accumulator, indices: list, values: list, keep: int):
    """The vote's scoring: (kept indices, their mean |value|, distinct proposed count)."""
    union, mean_abs = sparse_mean(accumulator, list(indices), [np.abs(v) for v in values])
    if keep >= union.size:
        return union, mean_abs, int(union.size)
    chosen = topk_exact(mean_abs, keep, nonnegative=True)
    return union[chosen], mean_abs[chosen], int(union.size)


def limit_apply(limit, union: np.ndarray, mean: np.ndarray, entries: int):
    """ServerLimit.apply on ``limit`` (its residual and support updated in place)."""
    if limit.support.size == 0 and union.size <= entries:
        return union, mean
    cands = sorted_union([union, limit.support])
    vals = limit.residual[cands]  # fancy indexing: a copy
    vals[np.searchsorted(cands, union)] += mean
    limit.residual[limit.support] = 0.0
    if cands.size <= entries:
        limit.support = np.empty(0, dtype=np.int64)
        return cands, vals
    kept = topk_exact(vals, entries)
    held = np.ones(cands.size, dtype=bool)
    held[kept] = False
    limit.support = cands[held]
    limit.residual[limit.support] = vals[held]
    return cands[kept], vals[kept]


def merge_parts(parts: list, edges: np.ndarray):
    """frames.merge_aggregates' arrays: (indices, values, dense) of S shards' aggregates (each
    (indices or None for dense, values)) over the whole vector."""
    numel = int(edges[-1])
    if any(i is None for i, _ in parts):
        values = np.zeros(numel, dtype=np.float32)
        for n, (i, v) in enumerate(parts):
            lo = int(edges[n])
            if i is None:
                values[lo:lo + v.size] = v
            else:
                values[i.astype(np.int64) + lo] = v
        return None, values
    indices = np.concatenate([i.astype(np.int64) + int(edges[n]) for n, (i, _) in enumerate(parts)])
    return indices, np.concatenate([v for _, v in parts])
