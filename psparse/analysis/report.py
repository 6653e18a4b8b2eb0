"""psparse-report: compare finished runs in a table and plots.

    psparse-report runs/a runs/b ... [--out DIR]

Prints one row per run (final and best test accuracy, union/k mean and p95, mean entries a worker
pushed per iteration ("k sent"), MB uploaded and broadcast, how much less than dense exchange,
iterations/s, and with --probe-recall the mean share of the global top-k the aggregate held),
for runs with key-range server shards (--servers S) each shard's MB up and
down, and writes PNG plots to DIR
(default ./report): send cost per iteration, union/k per iteration, test accuracy against
iterations and against wall time -- one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..rundir import CONFIG_FILE, EVAL_FILE, METRICS_FILE, SUMMARY_FILE, read_json, read_jsonl
from ..server.records import merge_run_dir
from ..wire.keyranges import shard_dir
from ..worker.recall import RECALL_FILE, summarise


def load_run(run_dir: Path) -> dict:
    if not (run_dir / SUMMARY_FILE).is_file() and shard_dir(run_dir, 0).is_dir():
        # shards started by hand on hosts without a shared run directory: merge their files
        # once they are all here
        shards = sum(1 for p in run_dir.glob("shard-*") if p.is_dir())
        merge_run_dir(run_dir, shards)
    if not (run_dir / SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {SUMMARY_FILE} (not a finished psparse run)")
    summary = read_json(run_dir, SUMMARY_FILE)
    config = read_json(run_dir, CONFIG_FILE) if (run_dir / CONFIG_FILE).is_file() else {}
    metrics, evals = read_jsonl(run_dir / METRICS_FILE), read_jsonl(run_dir / EVAL_FILE)
    sparse = [m for m in metrics if "union" in m]  # a DDP baseline run has no union
    budget = np.array([m.get("budget", max(m["k"]) or 1) for m in sparse], dtype=float)
    union_k = np.array([m["union"] for m in sparse], dtype=float) / np.maximum(budget, 1)
    label = run_dir.name
    if summary.get("baseline"):
        label += f" ({summary['baseline']})"
    elif config.get("script"):
        label += f" ({config['script'].split()[0]}, {config.get('policy')})"
    elif config.get("policy"):
        label += f" ({config['policy']})"
    recall = summarise(read_jsonl(run_dir / RECALL_FILE))  # --probe-recall runs only
    return {"dir": run_dir, "label": label, "short": short_label(summary, config),
            "summary": summary, "config": config, "metrics": metrics, "evals": evals,
            "union_k": union_k, "recall": recall}


def short_label(summary: dict, config: dict) -> str:
    """A plot's name for a run: the baseline, or the policy with its arguments and the
    density ("vote keep=1.5, 1%"); ``plot`` adds the run directory's name where two runs
    would share one."""
    if summary.get("baseline"):
        rank = config.get("powersgd_rank")
        return summary["baseline"] + (f" rank {rank}" if rank else "")
    policy = " ".join([str(config.get("policy", "?")), *(config.get("policy_args") or [])])
    density = config.get("density")
    return policy + (f", {100 * density:g}%" if density is not None else "")


def row(run: dict) -> dict:
    s, evals = run["summary"], run["evals"]
    sent = s["upload_mb"] + s["broadcast_mb"]
    # --local-steps H: an iteration is a synchronisation of H training steps
    local_steps = run.get("config", {}).get("local_steps") or 1
    syncs = s.get("iterations") or 0
    accs = [e["test_acc"] for e in evals if "test_acc" in e]
    return {
        "run": run["label"],
        "test_acc": s.get("test_acc"),
        "best_acc": max(accs) if accs else s.get("test_acc"),
        "union_k_mean": float(run["union_k"].mean()) if run["union_k"].size else None,
        "union_k_p95": float(np.percentile(run["union_k"], 95)) if run["union_k"].size else None,
        # entries a worker actually pushed per iteration (a policy may send fewer than k)
        "pushed_k_mean": s.get("pushed_k_mean"),
        "upload_mb": s["upload_mb"],
        "broadcast_mb": s["broadcast_mb"],
        "vs_dense": s["dense_mb"] / sent if sent else None,
        "local_steps": local_steps,
        # the send cost (pushes and broadcasts, all workers) per synchronisation and per step
        "kb_per_sync": 1e3 * sent / syncs if syncs else None,
        "kb_per_step": 1e3 * sent / (syncs * local_steps) if syncs else None,
        "iterations_per_s": s["iterations_per_s"],
        # --probe-recall: the share of the global top-k in the aggregate, mean over probes
        "recall": run.get("recall", {}).get("recall_mean"),
        # key-range server shards: each one's share of the bytes (absent with one server)
        "shards": [{k: x[k] for k in ("shard", "key_range", "upload_mb", "broadcast_mb")}
                   for x in s.get("shards", [])],
    }


def format_table(rows: list[dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = (f"{'run':<32}{'acc %':>8}{'best %':>8}{'union/k':>9}{'p95':>7}{'k sent':>8}"
            f"{'MB up':>9}"
            f"{'MB down':>10}{'vs dense':>10}{'it/s':>7}{'recall':>8}{'H':>4}{'KB/step':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run'][:31]:<32}{f(r['test_acc'] and 100 * r['test_acc'], '.2f'):>8}"
                     f"{f(r['best_acc'] and 100 * r['best_acc'], '.2f'):>8}"
                     f"{f(r['union_k_mean'], '.2f'):>9}{f(r['union_k_p95'], '.2f'):>7}"
                     f"{f(r['pushed_k_mean'], '.0f'):>8}"
                     f"{r['upload_mb']:>9.1f}{r['broadcast_mb']:>10.1f}"
                     f"{f(r['vs_dense'], '.1f'):>9}x{f(r['iterations_per_s'], '.1f'):>7}"
                     f"{f(r['recall'], '.3f'):>8}{r['local_steps']:>4}"
                     f"{f(r['kb_per_step'], '.1f'):>9}")
    sharded = [r for r in rows if r["shards"]]
    if sharded:
        lines += ["", "per server shard (keys, MB up, MB down):"]
        for r in sharded:
            lines.append(f"{r['run'][:31]:<32}" + "  ".join(
                f"#{x['shard']} [{x['key_range'][0]}, {x['key_range'][1]}) "
                f"{x['upload_mb']:.3g} / {x['broadcast_mb']:.3g}" for x in r["shards"]))
    return "\n".join(lines)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    if y.size < window or window <= 1:
        return y
    return np.convolve(y, np.ones(window) / window, mode="valid")


def plot(runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def figure(name, title, xlabel, ylabel, series, references=()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, x, y in series:
            # few points (sparse evaluations) get markers, or a single one would not show
            ax.plot(x, y, lw=1.2, label=label, marker="o" if len(x) < 30 else None, ms=4)
        for y, text in references:  # horizontal guides, e.g. union/k's bounds
            ax.axhline(y, color="0.5", lw=0.8, ls=":")
            ax.annotate(text, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7,
                        color="0.4", va="bottom")
        if references:  # room above the highest guide for its words
            top = max([y for y, _ in references] + [max(y) for _, _, y in series if len(y)])
            ax.set_ylim(0, 1.1 * top)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    window = max(1, min(len(r["metrics"]) for r in runs) // 50)
    names = [r["short"] for r in runs]
    names = [f"{n} ({r['dir'].name})" if names.count(n) > 1 else n for n, r in zip(names, runs)]
    fig, ax = plt.subplots(figsize=(7, 4))  # the send cost: pushes and broadcasts apart
    for n, (name, r) in enumerate(zip(names, runs)):
        it = np.array([m["iter"] for m in r["metrics"]])
        x = it[window - 1:] if window > 1 else it
        colour = f"C{n % 10}"
        if r["summary"].get("baseline"):
            ring = np.array([m.get("allreduce_bytes", 0) for m in r["metrics"]]) / 1e3
            ax.plot(x, smooth(ring, window), color=colour, lw=1.2, label=f"{name}: ring")
            continue
        for key, style, what in (("upload_bytes", "-", "pushes"),
                                 ("broadcast_bytes", "--", "broadcast")):
            kb = np.array([m.get(key, 0) for m in r["metrics"]]) / 1e3
            ax.plot(x, smooth(kb, window), color=colour, ls=style, lw=1.2,
                    label=f"{name}: {what}")
    ax.set_title("Send cost per iteration, all workers (solid: pushes, dashed: broadcast)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("KB per iteration")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "send_cost.png", dpi=90)
    plt.close(fig)
    written.append(out / "send_cost.png")
    unions, acc_it, acc_t = [], [], []
    for name, r in zip(names, runs):
        it = np.array([m["iter"] for m in r["metrics"]])
        if r["union_k"].size:
            unions.append((name, it[window - 1:] if window > 1 else it,
                           smooth(r["union_k"], window)))
        evals = [e for e in r["evals"] if "test_acc" in e]  # a language model logs a loss
        if evals:
            acc_it.append((name, [e["iter"] + 1 for e in evals],
                           [100 * e["test_acc"] for e in evals]))
            acc_t.append((name, [e.get("time_s", np.nan) for e in evals],
                          [100 * e["test_acc"] for e in evals]))
    # union/k lies between 1 (every worker chose the same k) and N (no two overlap)
    worlds = sorted({r["summary"].get("world_size") for r in runs if r["union_k"].size} - {None})
    figure("union_k.png", "Server broadcast size: union / k", "iteration", "union / k", unions,
           references=[(1, "1: every worker agrees")] +
           [(n, f"N = {n}: no overlap") for n in worlds])
    if acc_it:
        figure("accuracy_iterations.png", "Test accuracy", "iteration", "test accuracy (%)",
               acc_it)
        figure("accuracy_time.png", "Test accuracy against wall time", "seconds",
               "test accuracy (%)", acc_t)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="psparse-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="run directories")
    p.add_argument("--out", type=Path, default=Path("report"), help="folder for the PNG plots")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.runs]
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"psparse-report: error: {exc}", file=sys.stderr)
        return 1
    rows = [row(r) for r in runs]
    print(format_table(rows))
    (args.out).mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(rows, indent=1))
    if not args.no_plots:
        for path in plot(runs, args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
