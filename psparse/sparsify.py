"""Top-k selection of an accumulator's largest-magnitude entries (CPU, numpy).

Two algorithms, one answer (the k indices of largest |x|, returned sorted):

* ``topk_exact``: ``numpy.argpartition`` on |x|. Used for small tensors, and as the fallback.
* ``topk_threshold``: estimate the magnitude of the k-th largest entry from a strided sample
  (~1% of x), lower it by a safety margin, then one streaming pass collects the indices with
  |x| >= threshold, block by block so the |x| scratch stays in cache; finally trim the (slightly
  more than k) candidates to exactly k with argpartition. If the estimate was too high and fewer
  than k candidates come back, the exact path runs instead, so the result is always exact.

``torch.topk`` on large 1-D CPU tensors is several times slower than either (see ``make bench``).
Ties at the k-th magnitude are broken deterministically (same input, same output).
"""

from __future__ import annotations

import numpy as np

# Below this size argpartition is as fast as anything, so there is no point estimating.
EXACT_BELOW = 1 << 20
BLOCK = 1 << 16  # elements per streaming block: 256 KiB of float32, fits in L2 with its scratch
SAMPLE_STRIDE = 97  # prime stride: ~1% sample, no aliasing with layer shapes (powers of two)
MARGIN = 1.25  # aim for 25% more candidates than k, so an unlucky sample rarely falls short


def topk_exact(x: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest |x| (exact)."""
    n = x.size
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(x)
    idx = np.argpartition(mag, n - k)[n - k:]
    idx.sort()
    return idx


class Selector:
    """Top-k selection with preallocated scratch, reusable across iterations for one size n."""

    def __init__(self, n: int, exact_below: int = EXACT_BELOW):
        self.n = n
        self.exact = n < exact_below
        if not self.exact:
            self._abs = np.empty(BLOCK, dtype=np.float32)
            self._mask = np.empty(BLOCK, dtype=bool)
        self.fallbacks = 0  # times the sampled threshold was too high (exact path used)

    def topk(self, x: np.ndarray, k: int) -> np.ndarray:
        if self.exact or k <= 0 or k >= x.size:
            return topk_exact(x, k)
        threshold = self.estimate_threshold(x, k)
        candidates = self.above(x, threshold)
        if candidates.size < k:
            self.fallbacks += 1
            return topk_exact(x, k)
        if candidates.size > k:
            mag = np.abs(x[candidates])
            keep = np.argpartition(mag, candidates.size - k)[candidates.size - k:]
            candidates = candidates[np.sort(keep)]
        return candidates

    def estimate_threshold(self, x: np.ndarray, k: int) -> float:
        sample = np.abs(x[::SAMPLE_STRIDE])
        # Expected number of sample entries at or above the k-th largest magnitude, with margin.
        want = min(sample.size, max(1, int(np.ceil(k * MARGIN * sample.size / x.size)) + 1))
        return float(np.partition(sample, sample.size - want)[sample.size - want])

    def above(self, x: np.ndarray, threshold: float) -> np.ndarray:
        """Sorted indices with |x| >= threshold, streaming x once in cache-sized blocks."""
        parts = []
        for start in range(0, x.size, BLOCK):
            block = x[start:start + BLOCK]
            m = block.size
            mag, mask = self._abs[:m], self._mask[:m]
            np.abs(block, out=mag)
            np.greater_equal(mag, threshold, out=mask)
            hits = np.flatnonzero(mask)
            if hits.size:
                parts.append(hits + start)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def split_k(k: int, sizes: list[int]) -> list[int]:
    """Split k across layers in proportion to their sizes (largest remainder; sums to k)."""
    total = sum(sizes)
    k = min(k, total)
    exact = [k * s / total for s in sizes]
    ks = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (ks[i] - exact[i], i))
    for i in order[: k - sum(ks)]:
        ks[i] += 1
    return [min(ki, s) for ki, s in zip(ks, sizes)]


def density_to_k(density: float, numel: int) -> int:
    """Entries per push for a density in (0, 1]; at least one."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return max(1, min(numel, int(round(density * numel))))

