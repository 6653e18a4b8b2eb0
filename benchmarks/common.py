"""Timing helpers shared by the benchmarks: medians of repeated runs, printed as ratios; and
``record``, which merges a script's figures into benchmarks/results/bench.json."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path


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


# ----------------------------------------------------------------------------- bench.json
RESULTS = Path(os.environ.get("PSPARSE_BENCH_JSON")
               or Path(__file__).resolve().parent / "results" / "bench.json")


def commit() -> str:
    """The commit the benchmark ran at (with "-dirty" when the work tree had changes)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!benchmarks/results"],
                               cwd=root, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def record(results: dict, path: Path = RESULTS) -> None:
    """Merge ``results`` ({key: figures}) into bench.json: each benchmark script writes only its
    own keys (each stamped with the commit and date it was measured at), the others' stay."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    stamp = {"commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
             "cores": os.cpu_count()}
    for key, figures in results.items():
        data[key] = {**figures, **stamp}
    data["commit"] = stamp["commit"]  # the last writer's
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def half_shared_pushes(rng, numel: int, k: int, n: int):
    """N sorted int32 pushes of k entries each, half of every push shared by all and half its
    own (as bench_scale.py's aggregation part), with standard-normal float32 values."""
    import numpy as np
    shared = rng.choice(numel, k // 2, replace=False)
    idx = []
    for _ in range(n):
        own = rng.choice(numel, k, replace=False)
        own = own[~np.isin(own, shared)][: k - k // 2]
        idx.append(np.sort(np.concatenate([shared, own])).astype(np.int32))
    return idx, [rng.standard_normal(i.size).astype(np.float32) for i in idx]
