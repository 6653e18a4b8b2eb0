"""Issue 16, item 3: why does `core` lose accuracy at density 0.1%, and which rule holds there?

    python -m experiments.low_density            # make exp-low-density (about 40 min here)

LeNet/MNIST, 8 workers, 2 epochs (468 iterations), density 0.1% (k = 62), seeds 0, 1, 2, every
worker recording its pushes and its accumulator (``--record-selections``): top-k, `core` as
shipped (own = 0.125: a core of 54 entries and 8 own per worker), `core` with a larger own
slice (own = 0.5: is the own slice too small a door for new large entries?), `core` with a
longer or shorter history (beta = 0.9 / 0.1: is the shared history stale?), `core` after a
density warm-up (``--density-warmup 1``: the first epoch at higher density builds the history
before k is small), and `vote` keep=1.5 and keep=2 (no history: the group's choice is made
from this round's proposals; keep=2 is the issue's bound union/k = 2.0). Top-k and core at 1% (seed 0) show the same measures where core works.

Per run, from the recordings (psparse.analysis.locality):
  * captured: the share of the accumulator's top-k energy that the push carried (1 for top-k);
    low means the rule spends its budget on entries that are not the most due;
  * backlog: ||accumulator|| / ||gradient|| before the push (error feedback's residual, in
    gradients): it grows when large entries wait;
  * shared by all, /k: the part of the union every worker pushed (the core, for core);
  * coverage: distinct indices pushed by any worker over the run, as a share of the model.

Results: experiments/results/low-density.{md,json}; runs in runs/low-density/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.harness import RESULTS, ROOT, made_by, md_table, mean_of, mean_sd
from experiments.run import run_one
from experiments.scaling import union_parts
from experiments.sweeps import LENET, SWEEP_POLICIES
from psparse.analysis import locality

CORE = SWEEP_POLICIES["core"]
RUNS = {
    "topk-d0.001": ["--density", "0.001", *SWEEP_POLICIES["topk"]],
    "core-d0.001": ["--density", "0.001", *CORE],
    "core-own0.5-d0.001": ["--density", "0.001", *CORE, "--policy-arg", "own=0.5"],
    "core-beta0.9-d0.001": ["--density", "0.001", *CORE, "--policy-arg", "beta=0.9"],
    "core-beta0.1-d0.001": ["--density", "0.001", *CORE, "--policy-arg", "beta=0.1"],
    "core-warmup-d0.001": ["--density", "0.001", *CORE, "--density-warmup", "1"],
    "vote-d0.001": ["--density", "0.001", *SWEEP_POLICIES["vote"]],
    # union/k = 2.0 exactly, the bound: on CIFAR-10 keep=1.5 fell 4.8 points short of
    # top-k at 0.1% where keep=2 came within its seed spread
    "vote-keep2-d0.001": ["--density", "0.001", "--policy", "vote", "--policy-arg", "keep=2"],
    "topk-d0.01": ["--density", "0.01", *SWEEP_POLICIES["topk"]],
    "core-d0.01": ["--density", "0.01", *CORE],
}
SEEDS = {name: [0, 1, 2] if name.endswith("d0.001") else [0] for name in RUNS}


def accumulator_measures(run_dir: Path) -> dict[str, float]:
    ranks = [locality.load(f) for f in sorted(run_dir.glob("selections-rank-*.npz"))]
    captured = np.mean([r["captured"] for r in ranks], axis=0)  # per iteration, over workers
    backlog = np.mean([r["backlog"] for r in ranks], axis=0)
    numel = sum(ranks[0]["layer_sizes"])
    ever = np.unique(np.concatenate([s for r in ranks for s in r["sent"]]))
    quarter = max(1, captured.size // 4)
    return {"captured": float(captured.mean()), "captured_last": float(captured[-quarter:].mean()),
            "backlog": float(backlog.mean()), "backlog_last": float(backlog[-quarter:].mean()),
            "coverage": ever.size / numel}


def table(rows: list[dict]) -> str:
    lines = []
    for name in RUNS:
        rs = [r for r in rows if r["run"] == name]
        ok = [r for r in rs if "failed" not in r]
        if not rs:
            continue
        if len(ok) < len(rs):
            bad = [f"s{r['seed']}: {r['failed'][:60]}" for r in rs if "failed" in r]
            note = f" ({len(rs) - len(ok)} failed: {'; '.join(bad)})"
        else:
            note = ""
        if not ok:
            lines.append([name, len(rs), f"failed{note}"] + [""] * 6)
            continue
        m = lambda key: mean_of(ok, key)  # noqa: E731
        lines.append([name, f"{len(ok)}{note}", mean_sd([100 * r["test_acc"] for r in ok]),
                      f"{m('union_k_mean'):.2f}", f"{m('all_k'):.2f}",
                      f"{m('captured'):.2f} ({m('captured_last'):.2f})",
                      f"{m('backlog'):.2f} ({m('backlog_last'):.2f})",
                      f"{100 * m('coverage'):.1f}%", f"{100 * m('sent_over_allreduce'):.2f}"])
    return md_table(["run", "seeds", "final acc % (± sample SD)", "union/k", "shared by all, /k",
                     "captured (last quarter)", "backlog (last quarter)", "coverage of the model",
                     "up + bcast, % of allreduce"], lines) + "\n\n" + made_by(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.low_density", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated run names")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        p.error(f"unknown run(s) {unknown}; valid: {', '.join(RUNS)}")
    plan = [(n, s) for s in (0, 1, 2) for n in names if s in SEEDS[n]]  # seed 0 of all first
    rows = []
    for i, (name, seed) in enumerate(plan):
        args_ = [*LENET, "--record-selections", *RUNS[name]]
        row = run_one("low-density", name, args_, seed, args.data_dir, 0.98,
                      label=f"{i + 1}/{len(plan)} ")
        if "failed" not in row:
            run_dir = ROOT / row["dir"]
            row.update(**union_parts(run_dir, row["workers"]), **accumulator_measures(run_dir))
        rows.append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "low-density.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (RESULTS / "low-density.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
