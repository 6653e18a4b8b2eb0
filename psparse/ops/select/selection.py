"""Top-k on the host in numpy (the compiled selection's reference) and index-set helpers.

Top-k on the host in numpy (xp): a sampled threshold, a blockwise compaction and a trim to
exactly k; the exact reference; and the index-set helpers the rounds share.

These are the numpy references of the compiled selection (``psparse/ops/select/select_kernels.py``,
which ``psparse/ops/select/sparsify.py`` dispatches to) and the code that runs for arrays the
kernels do not take. The GPU's selection is the radix engine (``psparse/ops/select/radix.py``),
which picks the same set. Top-k order (both devices, so CPU and GPU workers pick identical sets):
larger |x| first, ties by lower index. Non-finite accumulators are refused with ``NonFiniteError``
(a NaN can never be "large", so selecting around it would hide a diverged run).
"""

from __future__ import annotations

import numpy as np

from ...xp import array_module
from .. import jit

select_kernels = jit.LazyModule("psparse.ops.select.select_kernels")

SAMPLE_STRIDE = 97  # prime stride: ~1% sample, no aliasing with layer shapes (powers of two)
MARGIN = 1.25  # aim for 25% more candidates than k, so an unlucky sample rarely falls short


class NonFiniteError(ValueError):
    """The accumulator holds NaN or infinity (the run diverged)."""


# ------------------------------------------------------------------------------- reference
def topk_reference(x, k: int):
    """Sorted indices of the k largest |x|, ties to the lower index. O(n log n); tests only."""
    xp = array_module(x)
    k = max(0, min(k, x.size))
    order = xp.lexsort(xp.stack([xp.arange(x.size, dtype=xp.float64),
                                 -xp.abs(x).astype(xp.float64)]))
    return xp.sort(order[:k]).astype(xp.int64)


# ------------------------------------------------------------------------------- selection
def estimate_threshold(x, k: int) -> float:
    """A magnitude that about MARGIN * k entries of x reach, from a strided ~1% sample."""
    return sample_threshold(array_module(x).abs(x[::SAMPLE_STRIDE]), k, x.size)


def sample_threshold(sample, k: int, n: int) -> float:
    """The magnitude about MARGIN * k of n entries reach, from the magnitudes of ``sample``,
    every SAMPLE_STRIDE-th of them."""
    xp = array_module(sample)
    # expected = how many of the sample the top k hold; its noise is ~sqrt(expected), so aim
    # 3 of those above it when that beats MARGIN (a top-k of ~1,400 of 11M, e.g. core's own
    # slice, has ~14 samples: MARGIN alone fell short 6 rounds in 40, and each costs a pass)
    expected = k * sample.size / n
    want = max(expected * MARGIN, expected + 3 * np.sqrt(expected))
    want = min(sample.size, max(1, int(np.ceil(want)) + 1))
    return float(xp.partition(sample, sample.size - want)[sample.size - want])


def trim(indices, values, k: int):
    """The k of the candidates (index, value) with largest |value|, ties to the lower index;
    returned as sorted indices and their values. O(candidates): one partition, two compares."""
    xp = array_module(values)
    if indices.size <= k:
        return indices, values
    mag = xp.abs(values)
    kth = xp.partition(mag, mag.size - k)[mag.size - k]  # the k-th largest magnitude
    keep = mag > kth
    short = k - int(xp.count_nonzero(keep))
    keep[xp.flatnonzero(mag == kth)[:short]] = True  # ties: the lowest indices
    return indices[keep], values[keep]


def exact_threshold(x, k: int) -> float:
    """The k-th largest |x| (every entry at or above it is a candidate)."""
    xp = array_module(x)
    mag = xp.abs(x)
    return float(xp.partition(mag, x.size - k)[x.size - k])


def select(x, k: int, compact):
    """Sorted indices of the k largest |x| (exact, ties to the lower index), and their values.

    ``compact(x, threshold, capacity)`` returns (indices, values, count): entries with
    |x| >= threshold, at most ``capacity`` of them, and how many there were in all. One sampled
    threshold, one compaction pass, a trim of ~1.25 k candidates; when the sample misjudged
    (too few, or more than the buffer holds) the exact k-th magnitude is used instead.
    """
    xp = array_module(x)
    n = x.size
    k = max(0, min(k, n))
    if k == 0:
        return xp.empty(0, xp.int64), xp.empty(0, x.dtype)
    capacity = 2 * k + 1024
    threshold = estimate_threshold(x, k) if k < n else 0.0
    idx, val, count = compact(x, threshold, capacity)
    if count < k or count > capacity:
        threshold = exact_threshold(x, k)
        idx, val, count = compact(x, threshold, capacity)
        if count > capacity:  # many ties at the k-th magnitude (e.g. zeros): room for all
            idx, val, count = compact(x, threshold, count)
    return trim(idx, val, k)


def compact_numpy(x: np.ndarray, threshold: float, capacity: int, block: int = 1 << 16,
                  scratch: np.ndarray | None = None):
    """CPU compaction: |x| >= threshold block by block, so the |x| scratch stays in cache."""
    parts = []
    mag_buf = scratch if scratch is not None else np.empty(min(block, x.size), np.float32)
    for start in range(0, x.size, block):
        chunk = x[start:start + block]
        mag = mag_buf[:chunk.size]
        np.abs(chunk, out=mag)
        if not np.isfinite(mag.max()):  # in cache; NaN and inf propagate through max
            raise NonFiniteError(f"the accumulator holds NaN or inf (first near index {start})")
        hits = np.flatnonzero(mag >= threshold)
        if hits.size:
            parts.append(hits + start)
    idx = np.concatenate(parts) if parts else np.empty(0, np.int64)
    count = idx.size
    idx = idx[:capacity]
    return idx, x[idx], count


def compact_scored(score, n: int, threshold: float, capacity: int, scratch: np.ndarray):
    """``compact_numpy`` of a score that is never written whole: ``score(sl, out)`` writes
    score[sl] into out, one block of ``scratch``'s size at a time, selected while in cache."""
    parts, values = [], []
    for start in range(0, n, scratch.size):
        block = scratch[:min(scratch.size, n - start)]
        score(slice(start, start + block.size), block)
        if not np.isfinite(block.max()):  # non-negative: NaN and inf propagate through max
            raise NonFiniteError(f"the score holds NaN or inf (first near index {start})")
        hits = np.flatnonzero(block >= threshold)
        if hits.size:
            parts.append(hits + start)
            values.append(block[hits])
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.float32), 0
    idx, val = np.concatenate(parts), np.concatenate(values)
    return idx[:capacity], val[:capacity], idx.size


def at_least(x, threshold: float, scratch=None):
    """Sorted indices of the entries with |x| >= threshold (on the host block by block, so the
    |x| scratch stays in cache and no n-sized array is made; NaN is never selected)."""
    xp = array_module(x)
    if xp is not np or scratch is None:
        return xp.flatnonzero(xp.abs(x) >= threshold)
    parts = []
    for start in range(0, x.size, scratch.size):
        chunk = x[start:start + scratch.size]
        mag = np.abs(chunk, out=scratch[:chunk.size])
        hits = np.flatnonzero(mag >= threshold)
        if hits.size:
            parts.append(hits + start)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def select_any(x, k: int):
    """``select`` on the host, with the blockwise compaction (the GPU's selection is the radix
    engine: psparse.ops.select.radix)."""
    return select(x, k, compact_numpy)


def slice_bounds(indices, slices) -> list[tuple[int, int]]:
    """For sorted global ``indices`` and slices [(offset, size), ...] in order: per slice, the
    (lo, hi) such that indices[lo:hi] are the slice's."""
    if len(slices) == 1:
        return [(0, indices.size)]
    xp = array_module(indices)
    edges = [offset for offset, _ in slices] + [slices[-1][0] + slices[-1][1]]
    bounds = xp.searchsorted(indices, xp.asarray(edges, dtype=indices.dtype)).tolist()
    return list(zip(bounds, bounds[1:]))


def sorted_union(indices: list):
    """Sorted distinct values of several index arrays (sort, then drop repeats).

    ``numpy.unique`` (numpy 2.x) is ~50x slower than this on 10^6 ints. Two sorted arrays (a
    policy's candidates and an aggregate) are merged by numpy's stable sort, which finds the two
    runs (2-4x faster than quicksort there; slower from about eight runs on).
    """
    xp = array_module(indices[0])
    merged = xp.concatenate(indices)
    if xp is np and len(indices) == 2:
        merged.sort(kind="stable")
    else:
        merged = xp.sort(merged)
    if merged.size < 2:
        return merged
    keep = xp.empty(merged.size, dtype=bool)
    keep[0] = True
    xp.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]
