"""Overlapping communication with backward (--overlap): how much of the wait it hides.

Two runs of the same configuration through real psparse-launch processes on loopback, with
the server's link paced (``--bandwidth``) so that communication matters: **sequential** (the
round in buckets of layers, ``--bucket-mb``, every bucket pushed after backward) and
**overlapped** (``--overlap``, the same buckets pushed from autograd hooks as soon as
backward has produced them). Both send the same messages and give identical results (checked
here: loss, union, final checksums); only when the buckets leave differs.

Per mode, from the workers' rank-R.json (means over ranks): the exposed wait per iteration
(``wait_s``: from the last push to the whole aggregate in hand) and the iteration time
(``train_s`` / iterations, from summary.json). The hidden fraction of communication is

    1 - exposed wait (overlapped) / wait (sequential)

Runs alternate between the modes (``--repeats`` pairs) and the figures are medians, as the
host's CPU is shared with other work: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import table  # noqa: E402

from psparse.rundir import read_jsonl  # noqa: E402

MODES = {"sequential": [], "overlapped": ["--overlap"]}
COMPARED = ("iter", "k", "union", "loss", "budget")


def default_data_dir() -> str:
    for d in (ROOT / "data", ROOT.parent / "shared" / "data"):
        if (d / "mnist").is_dir():
            return str(d)
    return str(ROOT / "data")


def run_once(out: Path, args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
           "--workers", str(args.workers), "--model", args.model, "--dataset", args.dataset,
           "--data-dir", args.data_dir, "--iterations", str(args.iterations),
           "--batch-size", str(args.batch_size), "--density", str(args.density),
           "--granularity", "layer", "--bucket-mb", str(args.bucket_mb),
           "--bandwidth", args.bandwidth, "--eval-every", "0", "--eval-samples", "100",
           "--threads", "1", "--seed", "0", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(args.workers)]
    metrics = read_jsonl(out / "metrics.jsonl")
    n = summary["iterations"]
    return {
        "iter_s": summary["train_s"] / n,
        "wait_s": statistics.mean(r["wait_s"] for r in ranks) / n,
        "compute_s": statistics.mean(r["compute_s"] for r in ranks) / n,
        "select_s": statistics.mean(r["select_s"] for r in ranks) / n,
        "buckets": len(ranks[0]["overlap"]["layers"]),
        "in_backward": ranks[0]["overlap"]["pushes_in_backward"] / n,
        "same": ([{k: m[k] for k in COMPARED} for m in metrics],
                 [r["checksum"] for r in ranks]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lenet")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=0.1)
    p.add_argument("--bandwidth", default="10Mbit")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs, alternating")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)

    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        for rep in range(args.repeats):
            for mode, extra in MODES.items():
                results[mode].append(run_once(Path(tmp) / f"{mode}-{rep}", args, extra))
    same = all(r["same"] == results["sequential"][0]["same"]
               for runs in results.values() for r in runs)

    def med(mode, key):
        return statistics.median(r[key] for r in results[mode])

    rows = [[mode, f"{med(mode, 'iter_s') * 1e3:.1f}", f"{med(mode, 'wait_s') * 1e3:.1f}",
             f"{med(mode, 'compute_s') * 1e3:.1f}", f"{med(mode, 'select_s') * 1e3:.1f}",
             f"{med(mode, 'in_backward'):.1f}"] for mode in MODES]
    hidden = 1 - med("overlapped", "wait_s") / med("sequential", "wait_s")
    # per pair too: the spread says how much the shared CPU moved the figure
    pairs = [1 - o["wait_s"] / s["wait_s"]
             for s, o in zip(results["sequential"], results["overlapped"])]
    speed = med("sequential", "iter_s") / med("overlapped", "iter_s")
    print(f"overlap: {args.model}/{args.dataset}, {args.workers} workers, batch "
          f"{args.batch_size}, density {args.density}, --granularity layer, "
          f"{results['sequential'][0]['buckets']} buckets of <= {args.bucket_mb} MB, server "
          f"link {args.bandwidth}, {args.iterations} iterations, {args.repeats} pairs "
          "(medians; the CPU is shared with other work: compare ratios, not times)")
    print(table(rows, ["mode", "iteration ms", "exposed wait ms", "compute ms", "select ms",
                       "pushes in backward"]))
    print(f"hidden fraction of communication: {hidden:.2f} (1 - overlapped wait / sequential "
          f"wait; per pair {', '.join(f'{h:.2f}' for h in pairs)})")
    print(f"iteration time, sequential / overlapped: {speed:.2f}x")
    print(f"identical results in every run (loss, union, k, final checksums): {same}")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "hidden_fraction": hidden,
            "hidden_per_pair": pairs, "speedup": speed, "identical": same,
            "runs": {m: [{k: v for k, v in r.items() if k != "same"} for r in runs]
                     for m, runs in results.items()}}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
