"""Top-k selection speed, as ratios against baselines measured in the same run.

For each size n and density: our ``Selector.topk`` (sampled threshold + streaming compaction)
versus one memory copy of n floats (``numpy.copyto``: how many "memory passes" selection costs),
versus ``numpy.argpartition`` on |x| (the exact baseline), and versus ``torch.topk(x.abs(), k)``.
Target: at 11.2M floats, selection within 3 memory passes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import median_time, table  # noqa: E402

from psparse.sparsify import Selector, topk_exact  # noqa: E402

SIZES = [61_706, 11_200_000, 25_000_000]
DENSITIES = [0.001, 0.01]


def main() -> int:
    rng = np.random.default_rng(0)
    rows = []
    for n in SIZES:
        # gradient-like: mostly small, a heavy tail of large entries
        x = (rng.standard_normal(n) * rng.standard_normal(n) ** 3).astype(np.float32)
        dst = np.empty_like(x)
        dst[:] = 1.0  # touch the pages before timing
        reps = 21 if n < 1_000_000 else 5
        t_copy = median_time(lambda: np.copyto(dst, x), reps)
        xt = torch.from_numpy(x)
        for density in DENSITIES:
            k = max(1, int(round(density * n)))
            sel = Selector(n)
            got = sel.topk(x, k)
            assert np.array_equal(got, topk_exact(x, k)), "selection is not exact"
            t_ours = median_time(lambda: sel.topk(x, k), reps)
            t_part = median_time(lambda: np.argpartition(np.abs(x), n - k), reps)
            t_torch = median_time(lambda: torch.topk(xt.abs(), k), max(3, reps // 2))
            rows.append([f"{n:,}", f"{density:.1%}", f"{k:,}", f"{t_ours * 1e3:.2f}",
                         f"{t_ours / t_copy:.2f}", f"{t_part / t_ours:.1f}x",
                         f"{t_torch / t_ours:.1f}x", "exact" if sel.exact else "threshold"])
    print("Top-k selection (median ms; ratios measured in this run)")
    print(table(rows, ["n", "density", "k", "ours ms", "copy passes", "vs argpartition",
                       "vs torch.topk", "path"]))
    print("copy passes = our time / one numpy.copyto of n float32 (target at 11.2M: <= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
