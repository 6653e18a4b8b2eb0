"""Figures of a finished sweep (PNG, small), written next to its table in experiments/results/.

* ``lenet-mnist``: accuracy against bytes broadcast, one point per run, per density (the
  thesis's question in one picture: does aligning shrink the broadcast without costing
  accuracy?), and test accuracy against iterations for the main policies at density 1%.
* ``paced-*``: test accuracy against wall time on the emulated link (--bandwidth).
* ``resnet20-cifar10``: test accuracy against iterations.
* ``cifar-lenet``: per density, test accuracy against iterations and against MB broadcast so
  far, seeds averaged (their range shaded).
* ``locality``: recurrence of top-k gradient indices and agreement between workers
  (``psparse-locality``), as PNG and text.

    python -m experiments.figures lenet-mnist     # from results/lenet-mnist.json and runs/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.harness import RESULTS, ROOT, RunDir, by_run


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display on the machines that run this)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, dpi: int = 80) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def tradeoff(rows: list[dict], path: Path, floor: float = 90.0) -> Path:
    """Final test accuracy against MB broadcast; filled: no limit, hollow: --server-limit 2k.

    One colour per policy in both panels; runs below ``floor`` % are listed under the axes."""
    plt = pyplot()
    ok = [r for r in rows if "failed" not in r]
    refs = {r["run"]: r for r in ok if r["run"] in ("dense", "ddp")}
    policies = list(dict.fromkeys(r["run"].split("-d0")[0] for r in rows if "-d0" in r["run"]))
    color = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.3), sharey=True)
    for ax, density in zip(axes, ("0.01", "0.001")):
        below = []
        for r in ok:
            if f"-d{density}" not in r["run"]:
                continue
            policy, limited = r["run"].split("-d0")[0], r["run"].endswith("limit2k")
            acc = 100 * r["test_acc"]
            if acc < floor:
                below.append(f"{r['run']} {acc:.1f}%")
                continue
            ax.scatter(r["broadcast_mb"], acc, s=40, color=color[policy],
                       facecolors="none" if limited else color[policy])
        if "dense" in refs:
            ax.axhline(100 * refs["dense"]["test_acc"], color="grey", ls="--", lw=1)
        failed = [r["run"] for r in rows if "failed" in r and f"-d{density}" in r["run"]]
        notes = [f"below {floor:g}%: " + ", ".join(below)] if below else []
        notes += ["diverged: " + ", ".join(failed)] if failed else []
        ax.text(0.0, -0.22, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="top")
        ax.set_xscale("log")
        ax.set_title(f"density {float(density):.1%} (hollow: --server-limit 2k)")
        ax.set_xlabel("MB broadcast by the server (whole run)")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker="o", color=color[p], label=p) for p in policies]
    if "dense" in refs:
        handles.append(plt.Line2D([], [], ls="--", color="grey",
                                  label=f"dense ({refs['dense']['broadcast_mb']:.0f} MB)"))
    axes[1].legend(handles=handles, fontsize=7, loc="lower right")
    axes[0].set_ylabel("final test accuracy (%)")
    axes[0].set_ylim(floor, 99.2)
    return save(fig, path)


def pivot(rows: list[dict]) -> str:
    """lenet-mnist as one line per policy: accuracy, union/k and MB broadcast per setting."""
    ok = {r["run"]: r for r in rows}
    settings = [("d0.01", "1%"), ("d0.01-limit2k", "1% + limit 2k"), ("d0.001", "0.1%"),
                ("d0.001-limit2k", "0.1% + limit 2k")]
    # upload + broadcast as % of a dense ring allreduce, per iteration (run.ALLREDUCE_DEFINITION),
    # where the rows have it (rows made before it was recorded do not)
    ratio = any("sent_over_allreduce" in r for r in rows)
    head = "| policy | " + " | ".join(label for _, label in settings) + " |"
    what = "acc % · union/k · MB" + (" · % of allreduce" if ratio else "")
    lines = [head, "|---" * (len(settings) + 1) + "|",
             "| | " + " | ".join(what for _ in settings) + " |"]

    def cell(r):
        if r is None:
            return "—"
        if "failed" in r:
            return "diverged" if "diverged" in r["failed"] else "failed"
        text = f"{100 * r['test_acc']:.2f} · {r['union_k_mean']:.2f} · {r['broadcast_mb']:.1f}"
        if ratio:
            text += f" · {100 * r['sent_over_allreduce']:.2f}" if "sent_over_allreduce" in r \
                else " · —"
        return text

    policies = sorted({name.split("-d")[0] for name in ok if "-d0" in name},
                      key=lambda p: [r["run"] for r in rows].index(f"{p}-d0.01"))
    for policy in policies:
        lines.append(f"| {policy} | " + " | ".join(cell(ok.get(f"{policy}-{suffix}"))
                                                  for suffix, _ in settings) + " |")
    for ref in ("dense", "ddp"):
        if ref in ok:
            lines.append(f"| {ref} (density 1.0) | {cell(ok[ref])} | | | |")
    if ratio:
        lines += ["", "% of allreduce: the workers' pushes plus the server's broadcast per "
                  "iteration, as a share of the bytes a dense ring allreduce sends "
                  "(experiments/run.py, ALLREDUCE_DEFINITION)."]
    return "\n".join(lines)


def _broadcast_at(run_dir: str) -> list[float]:
    """Cumulative MB broadcast by the server after each iteration (a baseline's ring traffic)."""
    total, out = 0.0, []
    for m in RunDir(ROOT / run_dir).metrics():
        total += m.get("broadcast_bytes", m.get("allreduce_bytes", 0) / 2) / 1e6
        out.append(total)
    return out


def curves(runs: list[tuple[str, str | list[str]]], path: Path, x: str, title: str,
           target: float | None = None) -> Path:
    """Test accuracy of (label, run_dir) pairs against iterations (x="iter"), seconds
    (x="time") or MB broadcast so far (x="broadcast", log scale). A label with a list of run
    directories (seeds) is drawn as their mean, with their range shaded."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, dirs in runs:
        dirs = [dirs] if isinstance(dirs, str) else dirs
        series = []
        for run_dir in dirs:
            evals = RunDir(ROOT / run_dir).evals()
            if x == "iter":
                xs = [e["iter"] + 1 for e in evals]
            elif x == "time":
                xs = [e["time_s"] for e in evals]
            else:
                sent = _broadcast_at(run_dir)
                xs = [sent[min(e["iter"], len(sent) - 1)] for e in evals]
            series.append((xs, [100 * e["test_acc"] for e in evals]))
        n = min(len(xs) for xs, _ in series)  # seeds evaluate at the same iterations
        xs = np.mean([xs[:n] for xs, _ in series], axis=0)
        accs = np.array([a[:n] for _, a in series])
        name = label if len(series) == 1 else f"{label} (mean of {len(series)} seeds)"
        line, = ax.plot(xs, accs.mean(axis=0), marker="o", ms=3, lw=1.2, label=name)
        if len(series) > 1:
            ax.fill_between(xs, accs.min(axis=0), accs.max(axis=0), color=line.get_color(),
                            alpha=0.15, lw=0)
    if target is not None:
        ax.axhline(100 * target, color="grey", ls=":", lw=1, label=f"target {100 * target:g}%")
    ax.set_xlabel({"iter": "iteration", "time": "wall time (s)",
                   "broadcast": "MB broadcast by the server so far (log)"}[x])
    if x == "broadcast":
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, path)


def build(sweep: str, stem: str, rows: list[dict]) -> list[Path]:
    """The figures of one sweep's rows (runs that failed are left out)."""
    ok = {r["run"]: r for r in rows if "failed" not in r}
    target = next((r["target_acc"] for r in ok.values()), None)
    written = []
    if sweep == "lenet-mnist":
        written.append(RESULTS / f"{stem}-summary.md")
        written[-1].write_text(pivot(rows) + "\n")
        written.append(tradeoff(rows, RESULTS / f"{stem}-tradeoff.png"))
        main = [(n, ok[n]["dir"]) for n in ("dense", "ddp", "topk-d0.01", "core-d0.01",
                                            "vote-d0.01", "cltk-d0.01") if n in ok]
        written.append(curves(main, RESULTS / f"{stem}-accuracy.png", "iter",
                              "LeNet-5 / MNIST, 8 workers: test accuracy", target))
    elif sweep.startswith("paced-"):
        rate = "20 Mbit/s" if sweep.endswith("20mbit") else "100 Mbit/s"
        written.append(curves([(n, r["dir"]) for n, r in ok.items()],
                              RESULTS / f"{stem}.png", "time",
                              f"LeNet-5 / MNIST, 8 workers, server link {rate}", target))
    elif sweep == "locality":
        from psparse.analysis import locality
        for name, r in ok.items():
            result = locality.analyse(ROOT / r["dir"])
            written.append(RESULTS / f"{stem}-{name}.png")
            locality.plot(result, written[-1])
            written.append(RESULTS / f"{stem}-{name}.txt")
            written[-1].write_text(locality.summary_text(result) + "\n")
    elif sweep == "cifar-lenet":
        # per density: every run (seeds averaged) and dense, against iterations and against
        # MB broadcast
        seeds = {name: [r["dir"] for r in rs]
                 for name, rs in by_run([r for r in rows if "failed" not in r]).items()}
        for density, label in (("0.01", "1%"), ("0.001", "0.1%")):
            runs = [(n, d) for n, d in seeds.items() if n == "dense" or n.endswith(f"-d{density}")]
            for x, what in (("iter", "iterations"), ("broadcast", "broadcast")):
                written.append(curves(
                    runs, RESULTS / f"{stem}-d{density}-{what}.png", x,
                    f"LeNet-5 / CIFAR-10, 8 workers, density {label}: test accuracy", target))
    elif sweep == "cifar-lenet-low":
        # with cifar-lenet's 0.1% rows (top-k, vote keep=1.5, core), from its table if written
        base = next((RESULTS / f"{name}.json" for name in ("cifar-lenet", "cifar-lenet-partial")
                     if (RESULTS / f"{name}.json").is_file()), None)
        more = [r for r in json.loads(base.read_text()) if r["run"].endswith("-d0.001")] \
            if base else []
        written.append(low_density_tradeoff(more + rows, RESULTS / f"{stem}-tradeoff.png"))
    elif sweep.startswith("resnet20-cifar10"):
        runs = [(n, r["dir"]) for n, r in ok.items()]
        written.append(curves(runs, RESULTS / f"{stem}-accuracy.png", "iter",
                              "ResNet-20 / CIFAR-10, 8 workers: test accuracy", target))
    return written


def low_density_tradeoff(rows: list[dict], path: Path) -> Path:
    """Final test accuracy against bytes moved (% of a dense allreduce's, log scale), one point
    per run (mean over its seeds, bars: the seeds' range), labelled with the run and its
    union/k: the CIFAR-10 trade-off at density 0.1% (issue 16, item 3)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for i, (name, rs) in enumerate(by_run([r for r in rows if "failed" not in r]).items()):
        acc = np.array([100 * r["test_acc"] for r in rs])
        sent = 100 * np.mean([r["sent_over_allreduce"] for r in rs])
        ax.errorbar(sent, acc.mean(), yerr=[[acc.mean() - acc.min()], [acc.max() - acc.mean()]],
                    fmt="o", color=f"C{i % 10}", capsize=3)
        ax.annotate(f"{name} (union/k {np.mean([r['union_k_mean'] for r in rs]):.2f}"
                    f"{', ' + str(len(rs)) + ' seeds' if len(rs) > 1 else ''})",
                    (sent, acc.mean()), textcoords="offset points", xytext=(6, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes pushed + broadcast, % of a dense ring allreduce's")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("LeNet-5 / CIFAR-10, 8 workers, density 0.1% unless named (chance 10%)",
                 fontsize=10)
    ax.margins(x=0.35, y=0.1)
    ax.grid(alpha=0.3)
    return save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stem", help="results/STEM.json to draw (a sweep name, or sweep-runs)")
    p.add_argument("--sweep", default=None, help="the sweep (default: the stem)")
    args = p.parse_args(argv)
    rows = json.loads((RESULTS / f"{args.stem}.json").read_text())
    for path in build(args.sweep or args.stem, args.stem, rows):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
