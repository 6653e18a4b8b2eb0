"""``make demo``: the project's point in one table.

The same 8 workers train LeNet-5 on MNIST through a real parameter server twice: with plain
top-k, where each worker picks mostly its own indices and the server broadcasts a union of ~6k
entries, and with the recommended aligning rule (``vote keep=1.5``: every worker proposes its
top-k, the server keeps the 1.5k proposals of largest mean magnitude and all push those), whose
union is 1.5k. The table puts both against what a dense ring allreduce of the same model (DDP)
would move. Each run is an ordinary ``psparse-launch`` run directory under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RUNS = [  # (label, psparse-launch flags)
    ("top-k", ["--policy", "topk"]),
    ("vote keep=1.5", ["--policy", "vote", "--policy-arg", "keep=1.5"]),
]


def launch(out: Path, flags: list[str], args) -> dict:
    """One run through psparse-launch, its progress lines shown; its summary.json."""
    argv = [sys.executable, "-m", "psparse.launch", "--workers", str(args.workers),
            "--density", str(args.density), "--epochs", str(args.epochs), "--eval-every", "0",
            "--out", str(out), "--overwrite", *(["--data-dir", str(args.data_dir)] if args.data_dir else []),
            *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the launcher's progress; its own summary table is the demo's
        lines.append(line)
        if line.startswith(("psparse:", "iter ")):
            print("  " + line, end="", flush=True)
    if proc.wait() != 0:
        sys.exit(f"demo: the run in {out} failed (exit code {proc.returncode}):\n"
                 + "".join(lines[-30:]))
    return json.loads((out / "summary.json").read_text())


def table(rows: list[tuple[str, dict]]) -> str:
    head = ("| policy | test accuracy | union/k | upload MB | broadcast MB | "
            "up + broadcast, % of a ring allreduce | it/s |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for label, s in rows:
        moved = s["upload_mb"] + s["broadcast_mb"]
        lines.append(f"| {label} | {100 * s['test_acc']:.2f}% | {s['union_over_k_mean']:.2f} | "
                     f"{s['upload_mb']:.1f} | {s['broadcast_mb']:.1f} | "
                     f"{100 * moved / s['allreduce_mb']:.2f}% | "
                     f"{s['train_iterations_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="parent of the two run directories (default runs/demo)")
    p.add_argument("--workers", type=int, default=8, help="workers per run (default 8)")
    p.add_argument("--epochs", type=float, default=3,
                   help="passes over each worker's shard of MNIST (default 3)")
    p.add_argument("--density", type=float, default=0.01,
                   help="k / numel, the share of entries each worker pushes (default 0.01)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where MNIST is (default: the launcher's, $PSPARSE_DATA or ./data)")
    args = p.parse_args(argv)
    rows = []
    for label, flags in RUNS:
        print(f"{label}: {args.workers} workers, LeNet-5/MNIST, density {args.density:g}, "
              f"{args.epochs:g} epochs", flush=True)
        out = args.out / label.split()[0].replace("-", "")
        rows.append((label, launch(out, flags, args)))
    (_, s), (_, v) = rows
    numel, k = s["numel"], s["k"]
    print(f"\n{table(rows)}\n")
    print(f"LeNet-5 has {numel:,} parameters; each worker pushes k = {k} of them per iteration. "
          f"A ring allreduce moves 2(N-1) x numel x 4 B per iteration; chance accuracy is 10%.")
    print(f"With top-k the {args.workers} workers disagree: the server broadcasts "
          f"{s['union_over_k_mean']:.1f}k entries to each. The aligning rule brings that to "
          f"{v['union_over_k_mean']:.1f}k: {v['broadcast_mb'] / s['broadcast_mb']:.0%} of "
          f"top-k's broadcast. Runs: {args.out}/{{topk,vote}} (psparse-report them for plots).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
