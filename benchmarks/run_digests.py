"""Digests of seven whole runs, to show that a refactor changed no computation.

    python benchmarks/run_digests.py --out /tmp/digests-before.json    # before the change
    python benchmarks/run_digests.py --out /tmp/digests-after.json --compare /tmp/digests-before.json

The seven runs (LeNet-5/MNIST, 3 workers, 60 iterations, seed 7, density 2%, an evaluation
every 30) cover the round's variants: one-phase (topk, core), two-phase (vote, cltk with
ScaleCom's memory), key-range shards (--servers 2), overlap with layer buckets (ema) and the
server's size limit (frequency). Each run's digest hashes metrics.jsonl and eval.jsonl
without their timing fields, every rank's final weight checksum, and the summary's status,
union/k, bytes, test accuracy and final loss: equal digests mean the same selections, the same
bytes on the wire and the same weights, bit for bit. Timings are not compared. Runs are
reproducible on the same machine and float kernels only (docs/api.md, "Determinism"), so
compare digests made on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ("--workers", "3", "--model", "lenet", "--dataset", "mnist", "--iterations", "60",
          "--seed", "7", "--density", "0.02", "--eval-every", "30")
RUNS = {
    "topk": ("--policy", "topk"),
    "core": ("--policy", "core"),
    "vote": ("--policy", "vote"),
    "cltk-scalecom": ("--policy", "cltk", "--memory", "scalecom"),
    "core-servers-2": ("--policy", "core", "--servers", "2"),
    "ema-overlap": ("--policy", "ema", "--granularity", "layer", "--overlap", "--bucket-mb",
                    "0.05"),
    "frequency-limit": ("--policy", "frequency", "--server-limit", "1.5k"),
}
# timings, and the index/value byte split that issue 39 added to every record (absent before
# it: leaving it out lets an fp32 run be compared with one made before value formats existed)
TIMING = ("round_s", "time_s", "upload_value_bytes", "broadcast_value_bytes")
SUMMARY_FIELDS = ("status", "union_over_k_mean", "upload_mb", "broadcast_mb", "test_acc",
                  "final_loss")


def untimed(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def digest(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    ranks = sorted(run.glob("rank-*.json"))
    content = {"metrics": untimed(run / "metrics.jsonl"), "eval": untimed(run / "eval.jsonl"),
               "checksums": [json.loads(r.read_text())["checksum"] for r in ranks],
               "summary": {k: summary.get(k) for k in SUMMARY_FIELDS}}
    blob = json.dumps(content, sort_keys=True).encode()
    return {"digest": hashlib.sha256(blob).hexdigest()[:16], **content["summary"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the digests (JSON)")
    p.add_argument("--compare", help="digests made earlier: exit 1 if any run differs")
    p.add_argument("--only", help="comma-separated run names (default: all seven)")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(RUNS)
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / name
            r = subprocess.run([sys.executable, "-m", "psparse.launch", "--quiet", "--out",
                                str(out), *COMMON, *RUNS[name]], capture_output=True, text=True,
                               env=os.environ.copy(), timeout=900)
            if r.returncode != 0:
                print(f"{name}: the launch failed\n{r.stdout}{r.stderr}", file=sys.stderr)
                return 2
            digests[name] = digest(out)
            print(f"{name:16} {digests[name]['digest']}  test_acc {digests[name]['test_acc']}",
                  flush=True)
    Path(args.out).write_text(json.dumps(digests, indent=1) + "\n")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [n for n in names if before.get(n, {}).get("digest") != digests[n]["digest"]]
    print("all identical" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
