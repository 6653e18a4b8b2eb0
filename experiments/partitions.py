"""Issue 32: exclusive-partition selection (micro, exdyna) against the aligning rules, and how
close each rule comes to the global top-k.

    python -m experiments.partitions                  # make exp-partitions: every part
    python -m experiments.partitions --part mnist     # LeNet/MNIST, 8 workers
    python -m experiments.partitions --part cifar     # LeNet-5/CIFAR-10, 8 workers
    python -m experiments.partitions --part n32       # LeNet/MNIST, 32 workers
    python -m experiments.partitions --part report    # tables and figure from partitions.json

Parts ``mnist`` and ``cifar``: 8 workers, densities 1% and 0.1%, seeds 0, 1, 2, every 25th
round probed (``--probe-recall 25``): top-k, ``vote`` keep=1.5 and keep=2, ``ema``, ScaleCom
(``cltk`` with ``--memory scalecom``), ``micro`` and ``exdyna``. MNIST: LeNet, 2 epochs (468
iterations, the base of the ``policies`` and ``scalecom`` sweeps). CIFAR-10: LeNet-5 with
cifar-lenet's settings (32 images per worker, SGD lr 0.05, momentum 0.9, weight decay 5e-4,
crop-and-flip) shortened to fit a 2-core machine: 5 epochs (975 iterations), lr x0.1 at epoch 4,
the whole test set at the end.

Part ``n32``: 32 workers on LeNet/MNIST at 1% for 4 epochs (234 iterations; the length of
exp-scaling's accuracy-long runs, where 2 epochs left the seeds spread widely), seeds 0, 1, 2:
top-k, vote keep=1.5, micro, exdyna.

Per run, beside accuracy, union/k and bytes (experiments.run.run_row):
  * recall: the share of the top-k of the sum of all workers' accumulators that the round's
    aggregate holds, mean over the probed rounds (psparse.worker.recall), and ``energy``, the share
    of that sum's squared norm at the aggregate's indices, beside ``energy_topk``, the share the
    sum's own top-k carries (the most any k entries can);
  * density error of a threshold controller: sum of the workers' selections (their
    proposals) / the round's budget k, minus 1, mean (signed) and mean |.| over rounds (micro
    and exdyna aim at k entries in all; the fixed-k rules send N·k or keep·k by construction:
    "-");
  * padding inefficiency, as ExDyna's code defines it for its all-gather of the selections:
    max_i k_i · N / sum_i k_i - 1 over the counts k_i each worker chose (micro and exdyna: its
    proposals, metrics.jsonl's ``proposals``), mean over rounds; shown for the two.

Runs land in runs/partitions-{mnist,cifar,n32}/ (a finished run is reused:
experiments.run.run_one); tables in experiments/results/partitions.md and .json, the figure in
experiments/results/partitions.png.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from experiments.figures import pyplot, save
from experiments.harness import RESULTS, ROOT, RunDir, made_by, md_table, mean_of, mean_sd
from experiments.run import run_one
from experiments.sweeps import LENET, SCALECOM_MEMORY, SWEEP_POLICIES
from psparse.rundir import read_jsonl
from psparse.worker.recall import RECALL_FILE, summarise

PROBE = ["--probe-recall", "25"]
POLICIES = {
    "topk": SWEEP_POLICIES["topk"],
    "vote-keep1.5": ["--policy", "vote", "--policy-arg", "keep=1.5"],
    "vote-keep2": ["--policy", "vote", "--policy-arg", "keep=2"],
    "ema": SWEEP_POLICIES["ema"],
    "scalecom": [*SWEEP_POLICIES["cltk"], *SCALECOM_MEMORY],
    "micro": ["--policy", "micro"],  # the authors' constants (psparse/policies/micro.py)
    # align=1: the code rounds block sizes down to 32 entries (memory alignment on a GPU), which
    # on LeNet's 61,706 entries would leave 47% of the model in the last partition
    "exdyna": ["--policy", "exdyna", "--policy-arg", "align=1"],
}
THRESHOLD_CONTROLLED = ("micro", "exdyna")  # aim at k entries in all, not N·k
DENSITIES = ("0.01", "0.001")
SEEDS = (0, 1, 2)
CIFAR = ["--workers", "8", "--model", "lenet", "--dataset", "cifar10", "--batch-size", "32",
         "--lr", "0.05", "--lr-steps", "4", "--momentum", "0.9", "--weight-decay", "5e-4",
         "--epochs", "5", "--eval-every", "0"]
PARTS = {
    "mnist": {"base": LENET, "densities": DENSITIES, "policies": tuple(POLICIES)},
    "cifar": {"base": CIFAR, "densities": DENSITIES, "policies": tuple(POLICIES)},
    "n32": {"base": ["--workers", "32", "--model", "lenet", "--dataset", "mnist",
                     "--epochs", "4", "--eval-every", "0"],
            "densities": ("0.01",), "policies": ("topk", "vote-keep1.5", "micro", "exdyna")},
}


def controller_measures(metrics: list[dict]) -> dict[str, float]:
    """Density error (signed and absolute) and padding inefficiency, means over rounds, from
    what each worker chose by itself: its proposals in a two-phase round (micro and exdyna
    propose their partition's entries over the threshold, then push at the union), else its
    push."""
    chosen = [m["proposals"] if m.get("proposals") is not None else m["k"] for m in metrics]
    pushed = np.array([sum(c) for c in chosen], dtype=float)
    budget = np.array([m["budget"] for m in metrics], dtype=float)
    most = np.array([max(c) * len(c) for c in chosen], dtype=float)
    error = pushed / budget - 1
    return {"density_error": float(error.mean()), "density_error_abs": float(np.abs(error).mean()),
            "padding": float(np.mean(most / np.maximum(pushed, 1) - 1))}


def run_part(part: str, data_dir: str | None, only: set[str] | None = None) -> list[dict]:
    spec = PARTS[part]
    plan = [(p, d, s) for s in SEEDS for d in spec["densities"] for p in spec["policies"]
            if only is None or p in only]  # seed 0 of every run first
    rows = []
    for i, (policy, density, seed) in enumerate(plan):
        name = f"{policy}-d{density}"
        args = [*spec["base"], "--density", density, *PROBE, *POLICIES[policy]]
        row = run_one(f"partitions-{part}", name, args, seed, data_dir, 0.98,
                      label=f"{i + 1}/{len(plan)} ")
        row.update(part=part, policy=policy, density=float(density))
        if "failed" not in row:
            run_dir = ROOT / row["dir"]
            row.update(**summarise(read_jsonl(run_dir / RECALL_FILE)),
                       **controller_measures(RunDir(run_dir).metrics()))
        rows.append(row)
    return rows


def table(rows: list[dict], part: str) -> str:
    lines = []
    for density in PARTS[part]["densities"]:
        for policy in PARTS[part]["policies"]:
            rs = [r for r in rows if r["part"] == part and r["policy"] == policy
                  and r["density"] == float(density)]
            ok = [r for r in rs if "failed" not in r]
            if not rs:
                continue
            if not ok:
                lines.append([f"{policy} d{density}", 0, f"failed: {rs[0]['failed'][:60]}"]
                             + [""] * 8)
                continue
            m = lambda key: mean_of(ok, key)  # noqa: E731
            controlled = policy in THRESHOLD_CONTROLLED
            lines.append([
                f"{policy} d{density}", len(ok) if len(ok) == len(rs) else
                f"{len(ok)} ({len(rs) - len(ok)} failed)",
                mean_sd([100 * r["test_acc"] for r in ok]), f"{m('union_k_mean'):.2f}",
                f"{100 * m('sent_over_allreduce'):.2f}",
                mean_sd([r["recall_mean"] for r in ok], ".3f"),
                f"{m('energy_mean'):.3f} / {m('energy_topk_mean'):.3f}",
                f"{100 * m('density_error'):+.1f}% ({100 * m('density_error_abs'):.1f}%)"
                if controlled else "-",
                f"{m('padding'):.2f}" if controlled else "-"])
    return md_table(["run", "seeds", "final acc % (± sample SD)", "union/k",
                     "up + bcast, % of allreduce", "recall of global top-k (± SD)",
                     "energy at union / at global top-k", "density error (mean |.|)",
                     "padding inefficiency"], lines) + "\n\n" + made_by(
        [r for r in rows if r["part"] == part])


def figure(rows: list[dict]) -> None:
    """Accuracy against bytes, one panel per data set and density: mean ± SD over seeds."""
    panels = [(p, d) for p in ("mnist", "cifar") for d in DENSITIES]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (part, density) in zip(axes, panels):
        for policy in POLICIES:
            ok = [r for r in rows if r["part"] == part and r["policy"] == policy
                  and r["density"] == float(density) and "failed" not in r]
            if not ok:
                continue
            acc = [100 * r["test_acc"] for r in ok]
            ax.errorbar(100 * mean_of(ok, "sent_over_allreduce"), np.mean(acc),
                        yerr=np.std(acc, ddof=1) if len(acc) > 1 else 0, fmt="o", capsize=3,
                        label=policy)
        ax.set_xscale("log")
        ax.set_title(f"{part} d={density}")
        ax.set_xlabel("up + bcast, % of dense allreduce")
        ax.set_ylabel("final test accuracy %")
    axes[0].legend(fontsize=7)
    save(fig, RESULTS / "partitions.png")


def report(rows: list[dict]) -> str:
    parts = [p for p in PARTS if any(r["part"] == p for r in rows)]
    text = "\n\n".join(f"### {p}\n\n{table(rows, p)}" for p in parts)
    (RESULTS / "partitions.md").write_text(text + "\n")
    figure(rows)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.partitions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS, "all", "report"], default="all")
    p.add_argument("--only", default=None,
                   help=f"comma-separated policies (default: the part's; of {', '.join(POLICIES)})")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(POLICIES):
        p.error(f"unknown policies {sorted(only - set(POLICIES))}; valid: {', '.join(POLICIES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "partitions.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    if args.part != "report":
        for part in (PARTS if args.part == "all" else [args.part]):
            new = run_part(part, args.data_dir, only)
            done = {(r["run"], r["seed"]) for r in new}
            rows = [r for r in rows if r["part"] != part or (r["run"], r["seed"]) not in done]
            rows += new
            path.write_text(json.dumps(rows, indent=1))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
