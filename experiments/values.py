"""Issue 39: fewer bits per entry. Value formats with error feedback at both ends, measured.

    python -m experiments.values            # make exp-values: LeNet/MNIST (about 25 min here)
    python -m experiments.values --cifar    # LeNet-5/CIFAR-10 (about 5 min a run here)
    python -m experiments.values --cifar --only cifar-ema-int4-d0.01,cifar-topk-int4-d0.01

LeNet/MNIST, 8 workers, 2 epochs (468 iterations; the section 7 setup), density 1% and 0.1%,
seeds 0, 1, 2: `topk`, `vote keep=1.5` and `ema` with values in fp32 (the baseline), int8, int4
and bf16 (the server's error memory on); ScaleCom (`cltk` + the scalecom memory) at int8; int8
and int4 without the server's memory (``--no-broadcast-memory``) for `topk` at 1%, to show what
that memory buys. ``--cifar``: LeNet-5/CIFAR-10 at section 3's 30 epochs (the `cifar-lenet`
sweep's settings), the same grid (the table says how many seeds each cell has), against that
sweep's fp32 runs (experiments/results/cifar-lenet.json: the same arguments but --values).

Per cell: final test accuracy (full test set; chance 10%) ± the sample SD over seeds, the bytes
on the wire (pushes + broadcasts, every process) as a share of a dense ring allreduce's, the
same as a share of `topk`-fp32's at that density, and the share of the bytes that are values
(metrics.jsonl's upload_value_bytes + broadcast_value_bytes; the rest is index frames and
headers). A run is reused when it has finished (runs/values/); ``--only`` runs just the named
cells, in the order given, and the tables are written from every finished run of the grid. A
run whose folder is gone keeps the row the results JSON recorded for it (with the commit that
made it); ``--keep-recorded`` also skips rerunning such runs, so a fresh clone can add cells to
the committed tables without redoing them.

Results: experiments/results/values.{md,json,png} and values-cifar.{md,json,png} (the figure:
accuracy against bytes as a share of topk-fp32's, per density, the goal's 0.3x drawn).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from experiments.harness import RESULTS, ROOT, RunCache, RunDir, made_by, md_table, mean_sd
from experiments.run import run_one, run_paths
from experiments.sweeps import LENET, SWEEP_POLICIES, SWEEPS

POLICIES = {"topk": SWEEP_POLICIES["topk"], "vote": SWEEP_POLICIES["vote"],
            "ema": SWEEP_POLICIES["ema"],
            "vote2": ["--policy", "vote", "--policy-arg", "keep=2"],
            "scalecom": ["--policy", "cltk", "--memory", "scalecom"]}
DENSITIES = ("0.01", "0.001")
SEEDS = (0, 1, 2)


def _grid(prefix: str, base: list[str], fp32: bool) -> dict[str, list[str]]:
    """Run name -> psparse-launch arguments (without the seed) of one dataset's grid; ``fp32``:
    include the fp32 cells (CIFAR-10 takes them from the cifar-lenet sweep instead)."""
    runs = {}
    for density in DENSITIES:
        d = [*base, "--density", density]
        for policy in ("topk", "vote", "ema"):
            for values in ("fp32", "int8", "int4", "bf16")[0 if fp32 else 1:]:
                runs[f"{prefix}{policy}-{values}-d{density}"] = [*d, *POLICIES[policy],
                                                                 "--values", values]
        runs[f"{prefix}vote2-int4-d{density}"] = [*d, *POLICIES["vote2"], "--values", "int4"]
        runs[f"{prefix}scalecom-int8-d{density}"] = [*d, *POLICIES["scalecom"],
                                                     "--values", "int8"]
    for values in ("int8", "int4"):
        runs[f"{prefix}topk-{values}-nomemory-d0.01"] = [
            *base, "--density", "0.01", *POLICIES["topk"], "--values", values,
            "--no-broadcast-memory"]
    return runs


RUNS = _grid("", LENET, fp32=True)
CIFAR = _grid("cifar-", SWEEPS["cifar-lenet"]["base"], fp32=False)
# the cifar-lenet sweep's fp32 runs that stand for the grid's fp32 cells
CIFAR_FP32 = {f"cifar-{p}-fp32-d{d}": f"{p}-d{d}" for d in DENSITIES
              for p in ("topk", "vote", "ema")}


def value_share(row: dict) -> float:
    """The value frames' share of a run's bytes (metrics.jsonl)."""
    metrics = RunDir(ROOT / row["dir"]).metrics()
    values = sum(m["upload_value_bytes"] + m["broadcast_value_bytes"] for m in metrics)
    total = sum(m["upload_bytes"] + m["broadcast_bytes"] for m in metrics)
    return values / total


def _short(code: str | None) -> str:
    """A code id as the table's column shows it: the commit's 7 digits, "+dirty" when it had
    uncommitted changes (the line under the table gives them whole)."""
    code = str(code)
    return code[:7] + ("+dirty" if "+dirty" in code else "")


def _density(name: str) -> str:
    return name.rsplit("-d", 1)[1]


def table(rows: list[dict], names, base_name) -> str:
    """One line per cell of ``names`` that has finished runs in ``rows``; ``base_name(density)``
    names the cell whose bytes are 1.000 (topk-fp32 at that density)."""
    lines = []
    for name in names:
        got = [r for r in rows if r["run"] == name and "test_acc" in r]
        if not got:
            continue
        base = [r for r in rows if r["run"] == base_name(_density(name)) and "test_acc" in r]
        base_bytes = np.mean([r["sent_bytes_per_iteration"] for r in base]) if base else None
        shares = [r["value_share"] for r in got if r.get("value_share") is not None]
        lines.append([
            name, len(got), mean_sd([100 * r["test_acc"] for r in got]),
            f"{100 * np.mean([r['sent_over_allreduce'] for r in got]):.2f}",
            "-" if base_bytes is None else
            f"{np.mean([r['sent_bytes_per_iteration'] for r in got]) / base_bytes:.3f}",
            f"{100 * np.mean(shares):.0f}" if shares else "-",
            " ".join(sorted({_short(r.get("code")) for r in got}))])
    return md_table(["run", "seeds", "final acc % (± sample SD)",
                     "bytes, % of dense allreduce", "bytes / topk-fp32's",
                     "values, % of bytes", "made by"], lines) + "\n\n" + made_by(rows)


def figure(rows: list[dict], base_name, path) -> None:
    """Accuracy (mean ± sample SD over seeds) against bytes as a share of topk-fp32's, one
    panel per density, one marker per policy, the format written beside each point; the
    goal's 0.3x and top-k-fp32's band (its mean ± SD) drawn."""
    from experiments.figures import pyplot, save
    plt = pyplot()
    fig, axes = plt.subplots(1, len(DENSITIES), figsize=(11, 4.2))
    markers = {"topk": "o", "vote": "s", "vote2": "D", "ema": "^", "scalecom": "v"}
    for ax, density in zip(axes, DENSITIES):
        base = [r for r in rows if r["run"] == base_name(density) and "test_acc" in r]
        if not base:
            continue
        base_bytes = np.mean([r["sent_bytes_per_iteration"] for r in base])
        acc = [100 * r["test_acc"] for r in base]
        sd = np.std(acc, ddof=1) if len(acc) > 1 else 0.0
        ax.axhspan(np.mean(acc) - sd, np.mean(acc) + sd, color="0.9", label="topk-fp32 ± SD")
        ax.axvline(0.3, color="0.5", linestyle=":", label="0.3x (the goal)")
        names = sorted({r["run"] for r in rows if r["run"].endswith(f"-d{density}")
                        and "nomemory" not in r["run"]})
        for name in names:
            got = [r for r in rows if r["run"] == name and "test_acc" in r]
            if not got:
                continue
            policy, fmt = name.removeprefix("cifar-").split("-")[:2]
            acc = [100 * r["test_acc"] for r in got]
            x = np.mean([r["sent_bytes_per_iteration"] for r in got]) / base_bytes
            ax.errorbar(x, np.mean(acc), yerr=np.std(acc, ddof=1) if len(acc) > 1 else None,
                        marker=markers.get(policy, "x"), color=f"C{list(markers).index(policy)}"
                        if policy in markers else "k", linestyle="none", capsize=2,
                        alpha=1.0 if len(got) > 1 else 0.5)
            ax.annotate(fmt, (x, np.mean(acc)), fontsize=7, xytext=(3, 2),
                        textcoords="offset points")
        for policy, marker in markers.items():
            ax.plot([], [], marker=marker, linestyle="none", color=f"C{list(markers).index(policy)}",
                    label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("bytes on the wire / topk-fp32's (log)")
        ax.set_ylabel("final test accuracy % (chance 10%)")
        ax.set_title(f"density {float(density):.1%} (faint: one seed)")
    axes[-1].legend(fontsize=7, loc="lower right")
    save(fig, path)


def _row(name: str, args: list[str], seed: int, data_dir, target: float, run: bool,
         progress: bool, label: str) -> dict | None:
    """The row of one run: run (or resumed) when ``run``, else only if it has finished."""
    if not run:
        out, _, identity = run_paths("values", name, args, seed, data_dir)
        if not RunCache(out, identity).finished():
            return None
    row = run_one("values", name, args, seed, data_dir, target, progress=progress, label=label)
    if "test_acc" in row:
        row["value_share"] = value_share(row)
    return row


def _recorded(path) -> list[dict]:
    """The finished runs' rows in an earlier results JSON, but for the fp32 rows copied in from
    cifar-lenet.json (they are read afresh from there)."""
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())
            if "test_acc" in r and r["run"] not in CIFAR_FP32]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.values", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="folder holding the data (default: data)")
    p.add_argument("--only", default=None,
                   help="comma-separated run names to run, in this order (default: all of "
                        "the grid); the tables still show every finished run")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds to run (default: 0,1,2)")
    p.add_argument("--cifar", action="store_true",
                   help="the LeNet-5/CIFAR-10 grid instead (results/values-cifar.{md,json})")
    p.add_argument("--keep-recorded", action="store_true",
                   help="do not rerun a run whose row the results JSON already holds (its "
                        "folder under runs/values/ is gone, e.g. on a fresh clone); the row, "
                        "with the commit that made it, goes into the tables as it is")
    args = p.parse_args(argv)
    grid = CIFAR if args.cifar else RUNS
    names = args.only.split(",") if args.only else list(grid)
    unknown = [n for n in names if n not in grid]
    if unknown:
        p.error(f"unknown run(s) {', '.join(unknown)}; the grid has: {', '.join(grid)}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(SEEDS)
    target, stem = (0.6, "values-cifar") if args.cifar else (0.98, "values")
    # A run whose folder is gone (a fresh clone) keeps the row the last table recorded for it;
    # that row names the commit that made it, so the table still says which code made what.
    recorded = {(r["run"], r["seed"]): r for r in _recorded(RESULTS / f"{stem}.json")}
    plan = [(n, s) for n in names for s in seeds
            if not (args.keep_recorded and (n, s) in recorded)]
    for i, (name, seed) in enumerate(plan):
        row = _row(name, grid[name], seed, args.data_dir, target, True, args.cifar,
                   f"{i + 1}/{len(plan)} ")
        print(f"{i + 1}/{len(plan)} {name} seed {seed}: "
              f"{row.get('test_acc', row.get('failed'))}", flush=True)
    rows = [r for n in grid for s in SEEDS
            if (r := _row(n, grid[n], s, args.data_dir, target, False, False, "")
                or recorded.get((n, s))) is not None]
    if args.cifar:
        earlier = json.loads((RESULTS / "cifar-lenet.json").read_text())
        for name, sweep_name in CIFAR_FP32.items():
            rows += [{**r, "run": name, "value_share": None}
                     for r in earlier if r["run"] == sweep_name]
        order = [n for n in [*CIFAR_FP32, *grid] if not n.endswith("nomemory-d0.01")]
        order = sorted(order, key=lambda n: (DENSITIES.index(_density(n)), order.index(n)))
        order += [n for n in grid if n.endswith("nomemory-d0.01")]
        base_name = lambda d: f"cifar-topk-fp32-d{d}"  # noqa: E731
        text = table(rows, order, base_name)
        text += ("\n\nThe fp32 rows are the cifar-lenet sweep's runs (same arguments but "
                 "--values; results/cifar-lenet.json), without a value share.")
    else:
        base_name = lambda d: f"topk-fp32-d{d}"  # noqa: E731
        text = table(rows, grid, base_name)
    RESULTS.mkdir(parents=True, exist_ok=True)
    figure(rows, base_name, RESULTS / f"{stem}.png")
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
