"""Server aggregation of 8 sparse pushes: ``sparse_mean`` vs the plain numpy way.

Both compute the same thing (sum into a dense scratch vector, union of indices, mean at the
union, scratch zeroed again). The baseline is what one writes first: one ``numpy.add.at`` over
the concatenated pushes and ``numpy.unique`` for the union. Ours scatters push by push (each
push's indices are sorted and unique, numpy's fast add.at path) and forms the union by sort and
de-duplication, which in numpy 2.x is far faster than ``numpy.unique``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import median_time, table  # noqa: E402

from psparse.server import sparse_mean  # noqa: E402

WORKERS = 8
CASES = [(61_706, 0.01), (11_200_000, 0.001), (11_200_000, 0.01), (25_000_000, 0.001)]


def add_at_mean(acc, indices, values):
    idx, val = np.concatenate(indices), np.concatenate(values)
    np.add.at(acc, idx, val)
    union = np.unique(idx)
    mean = acc[union] / np.float32(len(indices))
    acc[union] = 0.0
    return union, mean


def main() -> int:
    rng = np.random.default_rng(0)
    rows = []
    for n, density in CASES:
        k = max(1, int(round(n * density)))
        # workers half agree: each push has k/2 shared indices and k/2 of its own
        shared = rng.choice(n, k // 2, replace=False)
        indices = [np.unique(np.concatenate([shared, rng.choice(n, k - k // 2, replace=False)]))
                   .astype(np.int32) for _ in range(WORKERS)]
        values = [rng.standard_normal(i.size).astype(np.float32) for i in indices]
        acc = np.zeros(n, np.float32)
        ours = sparse_mean(acc, indices, values)
        ref = add_at_mean(acc, indices, values)
        assert np.array_equal(ours[0], ref[0]) and np.allclose(ours[1], ref[1], atol=1e-6)
        reps = 15 if n < 1_000_000 else 5
        t_ours = median_time(lambda: sparse_mean(acc, indices, values), reps)
        t_ref = median_time(lambda: add_at_mean(acc, indices, values), reps)
        rows.append([f"{n:,}", f"{density:.1%}", f"{k:,}", f"{ours[0].size:,}",
                     f"{t_ours * 1e3:.2f}", f"{t_ref * 1e3:.2f}", f"{t_ref / t_ours:.1f}x"])
    print(f"Server aggregation of {WORKERS} pushes (median ms; ratio measured in this run)")
    print(table(rows, ["numel", "density", "k", "union", "ours ms", "add.at+unique ms", "speedup"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
