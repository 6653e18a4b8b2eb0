"""Top-k selection of an accumulator's largest-magnitude entries, on the host or the GPU.

Two algorithms, one answer (the k indices of largest |x|, ties to the lower index, sorted):

* ``topk_exact``: ``numpy.partition`` for the k-th magnitude, then the entries above it and the
  lowest-index ties. Used for small tensors (below ``EXACT_BELOW``).
* ``Selector.topk`` on large tensors: ``selection.select`` -- estimate the k-th magnitude from a
  strided ~1% sample, lowered by a margin, one streaming pass collects the candidates at or above
  it (block by block so the |x| scratch stays in cache), then the
  ~1.25 k candidates are trimmed to exactly k. If the estimate misjudged, the exact k-th
  magnitude is used, so the result is always exact.

On the host both run compiled (``psparse/ops/select/select_kernels.py``, numba: the sample, one pass
that looks at |acc| 128 and then 16 entries at a time, the trim, in one call), the numpy code above
their test oracle, run only with ``PSPARSE_CPU_KERNELS=numpy`` (``psparse/ops/jit.py``) or for an
array the kernels do not take (not contiguous float32: a user policy's score). On the GPU
(``--device cuda``) selection is the radix engine (``psparse.ops.select.radix``): the same set.
``torch.topk`` on large 1-D CPU tensors is several times slower than either (see ``make bench``).
"""

from __future__ import annotations

import numpy as np

from .. import jit
from ..jit import host_compiled
from . import selection
from .selection import NonFiniteError

select_kernels = jit.LazyModule("psparse.ops.select.select_kernels")

__all__ = ["EXACT_BELOW", "NonFiniteError", "Selector", "density_to_k", "host_compiled",
           "positions", "split_k", "topk_exact"]

# Below this size partition is as fast as anything, so there is no point estimating.
EXACT_BELOW = 1 << 20
BLOCK = 1 << 16  # elements per streaming block: 256 KiB of float32, fits in L2 with its scratch


def topk_exact(x: np.ndarray, k: int, nonnegative: bool = False, also=None) -> np.ndarray:
    """Sorted indices of the k largest |x| (exact; ties to the lower index). ``nonnegative``:
    x is known to be >= 0 (a policy's score), so |x| is x. ``also``: sorted distinct indices
    to add to the answer (the sorted union of both is returned)."""
    n = x.size
    if k <= 0:
        return np.empty(0, dtype=np.int64) if also is None else also.astype(np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    mag = x if nonnegative else np.abs(x)
    if not np.isfinite(mag.max()):  # non-negative: NaN and inf propagate through max
        raise NonFiniteError("the accumulator holds NaN or inf")
    kth = np.partition(mag, n - k)[n - k]
    keep = mag > kth
    short = k - int(np.count_nonzero(keep))
    if short:  # ties at the k-th magnitude: the lowest indices
        keep[np.flatnonzero(mag == kth)[:short]] = True
    if also is not None:
        keep[also] = True
    return np.flatnonzero(keep)  # a mask, not union1d: numpy 2's hash-based unique is slow


class Selector:
    """Top-k selection with preallocated scratch, reusable across iterations for one size n."""

    def __init__(self, n: int, exact_below: int = EXACT_BELOW):
        self.n = n
        self.exact = n < exact_below
        self._abs = None if self.exact else np.empty(BLOCK, dtype=np.float32)
        self._passes = 0
        self.fallbacks = 0  # times the sampled threshold misjudged (exact threshold used)

    def topk(self, x, k: int):
        if 0 < k < x.size and host_compiled(x):
            return self.scored(x, k)
        if self.exact or k <= 0 or k >= x.size:
            return topk_exact(x, k)
        self._passes = 0
        indices, _ = selection.select(x, k, self._compact)
        self.fallbacks += self._passes > 1
        return indices

    def scored(self, acc, k: int, kind: int = 0, aux=None, marks=None, p: float = 1.0,
               q: float = 1.0):
        """Sorted indices of the k largest scores of ``acc`` (a slice of n), compiled
        (``select_kernels.top_k``: ``kind`` ABS, |acc|; EMA, |acc| * (aux + p), aux <= q - p;
        PENALTY, |acc| times p off the sorted ``marks``; CORE, |acc| with ``marks`` first);
        ties to the lower index, as ``topk_exact`` of the score would answer."""
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        if k >= acc.size:
            return np.arange(acc.size, dtype=np.int64)
        out = np.empty(k, np.int64)
        status = select_kernels.top_k(
            kind, acc, select_kernels.NO_AUX if aux is None else aux,
            select_kernels.NO_MARKS if marks is None else marks, np.float32(p), np.float32(q),
            k, out)
        if status < 0:
            raise NonFiniteError(f"the accumulator holds NaN or inf (first at index {-1 - status})")
        self.fallbacks += status
        return out

    def _compact(self, x, threshold, capacity):
        self._passes += 1
        return selection.compact_numpy(x, threshold, capacity, BLOCK, self._abs)

    def topk_scored(self, score, k: int, full):
        """``topk`` of a non-negative score that ``score(sl, out)`` writes, score[sl] into out.

        On a large host slice the score is made one cache-sized block at a time and selected
        while in cache: no n-sized score array is written, one pass in all. Otherwise (small
        slices, or when the sampled threshold misjudged) it is written into ``full``
        (n floats, the caller's scratch) and selected as ``topk`` does. Same answer either way.
        """
        n = self.n
        if self.exact or k <= 0 or k >= n:
            score(slice(0, n), full)
            return topk_exact(full, k, nonnegative=True) if self.exact else self.topk(full, k)
        sample = np.empty(len(range(0, n, selection.SAMPLE_STRIDE)), np.float32)
        score(slice(0, n, selection.SAMPLE_STRIDE), sample)
        capacity = 2 * k + 1024
        idx, val, count = selection.compact_scored(
            score, n, selection.sample_threshold(sample, k, n), capacity, self._abs)
        if count < k or count > capacity:
            self.fallbacks += 1
            score(slice(0, n), full)
            return self.topk(full, k)
        return selection.trim(idx, val, k)[0]


def positions(indices, sl: slice, n: int):
    """Where sorted distinct ``indices`` of a slice of n entries fall in the part ``sl`` of it
    that a ``Selector.topk_scored`` score is asked for (the whole slice, one block, or a strided
    sample): positions into that part. Blocks and samples are asked for on the host only."""
    start, stop, step = sl.indices(n)
    if step == 1 and start == 0 and stop == n:
        return indices
    if step == 1:  # two scalar searches: a list argument costs a conversion per block
        return indices[int(indices.searchsorted(start)):int(indices.searchsorted(stop))] - start
    on = indices[(indices >= start) & (indices < stop) & ((indices - start) % step == 0)]
    return (on - start) // step


def split_k(k: int, sizes: list[int]) -> list[int]:
    """Split k across layers (``--granularity layer``): every layer gets one entry, the rest
    goes in proportion to the layers' sizes beyond that one (largest remainder, ties to the
    lower layer); sums to min(k, sum of sizes). A layer never gets 0 while k allows one each,
    or a small one (a bias at 1%: 0.06 of an entry) would never be sent and never train,
    its accumulator growing for ever (GRACE sends at least one entry per tensor too). With
    fewer entries than layers, the k largest layers get one each."""
    total, n = sum(sizes), sum(s > 0 for s in sizes)  # (an empty layer gets nothing)
    k = min(k, total)
    if k < n:
        chosen = set(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))[:k])
        return [1 if i in chosen else 0 for i in range(len(sizes))]
    rest, room = k - n, [max(0, s - 1) for s in sizes]
    spare = total - n
    exact = [rest * r / spare if spare else 0.0 for r in room]
    ks = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (ks[i] - exact[i], i))
    for i in order[: rest - sum(ks)]:
        ks[i] += 1
    return [(1 if s > 0 else 0) + min(ki, r) for ki, r, s in zip(ks, room, sizes)]


def density_to_k(density: float, numel: int) -> int:
    """Entries per push for a density in (0, 1]; at least one."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return max(1, min(numel, int(round(density * numel))))

