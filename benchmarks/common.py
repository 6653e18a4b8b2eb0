"""Timing helpers shared by the benchmarks: medians of repeated runs, printed as ratios."""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved_medians(baseline, candidate, repeats: int = 9, warmup: int = 2):
    """Median times of two functions run alternately, so drift in machine load hits both."""
    for _ in range(warmup):
        baseline()
        candidate()
    tb, tc = [], []
    for _ in range(repeats):
        for fn, out in ((baseline, tb), (candidate, tc)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(tb), statistics.median(tc)


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
