"""Run a named experiment sweep with psparse-launch and write its results table.

    python -m experiments.run policies            # every policy, LeNet/MNIST, 8 workers
    python -m experiments.run policies --only core,topk --seeds 0,1,2

The sweeps are listed in experiments/sweeps.py. Each run's directory lands in
runs/<sweep>/<run>-s<seed>/; the table (markdown) and the raw figures (JSON) in
experiments/results/<sweep>.{md,json}. Runs that finished with the same configuration are
reused, and a run stopped part-way continues from its newest checkpoint when the sweep saves
them (--checkpoint-every), so an interrupted sweep resumes where it stopped.
Seeds: --seeds for every run, else the sweep's own per run ("seeds"), else 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments import figures
from experiments.harness import (
    RESULTS,
    ROOT,
    RunCache,
    RunDir,
    by_run,
    made_by,
    md_table,
    mean_of,
    mean_sd,
)
from experiments.sweeps import SWEEPS
from psparse import checkpoint
from psparse.provenance import provenance

# Exit codes of a launcher that was stopped rather than one whose run failed: interrupted
# (130: SIGINT or SIGTERM), or killed by a signal (negative).
INTERRUPTED = 130


def sent_per_iteration(metrics: list[dict]) -> float:
    """Mean bytes on the wire per iteration, all processes: pushes plus broadcast, or a
    baseline's ring traffic."""
    return float(np.mean([m["allreduce_bytes"] if "allreduce_bytes" in m
                          else m["upload_bytes"] + m["broadcast_bytes"] for m in metrics]))


def union_over_k(metrics: list[dict]) -> np.ndarray:
    """union / k per round (k: the round's budget)."""
    return np.array([m["union"] / m.get("budget", max(m["k"])) for m in metrics])


def epochs_to_near_best(evals: list[dict], within: float = 0.01):
    """The epoch of the first evaluation within ``within`` (accuracy, 0.01 = 1 point) of the
    run's best: how long the run took to get about as far as it got (under a step schedule,
    mostly where the first step falls)."""
    best = max(e["test_acc"] for e in evals)
    return next(e.get("epoch") for e in evals if e["test_acc"] >= best - within)


# exit statuses of a run stopped (by a time limit, or a session that ended) rather than failed
STOPPED = (INTERRUPTED, -signal.SIGKILL, -signal.SIGINT, -signal.SIGTERM)


def exit_status(run_dir: Path) -> int | None:
    """A run's exit status as its summary tells it: 0 (finished), 130 (stopped by a signal),
    1 (failed), or None (no summary: still running, or killed before writing one)."""
    summary = RunDir(run_dir).summary()
    if summary is None:
        return None
    if summary.get("status") == "ok":
        return 0
    # the server's own summary says "terminated by signal"; one the launcher wrote when it
    # was stopped first records its exit code in the last attempt
    attempts = summary.get("attempts") or [{}]
    stopped = attempts[-1].get("exit_code") in STOPPED or "signal" in str(summary.get("error"))
    return INTERRUPTED if stopped else 1


def reached(run_dir: Path, name: str, seed: int, exit_code: int | None) -> dict:
    """How far one run got, from its run directory, whether it finished or not: epochs and
    iterations reached, the last and best test accuracy of its evaluations, union/k and bytes
    per iteration over a dense ring allreduce's (as the sweep table), training iterations per
    second. What was reached, not a projection."""
    row = {"run": name, "seed": seed, "exit": exit_code, "dir": run_dir.name}
    run = RunDir(run_dir)  # complete lines only: a running run may be part-way through one
    metrics, evals, config, summary = run.metrics(), run.evals(), run.config(), run.summary()
    row["finished"] = summary is not None and exit_code == 0
    row["code"] = run.code_id()
    if not metrics:
        row["failed"] = "no iteration recorded (see the launcher log)"
        return row
    summary = summary or {}
    # the model's size: the summary's (written also by a stopped run's server), else from k
    # (a DDP baseline's rounds have no k: its ring traffic is the allreduce, 100%)
    numel = summary.get("numel") or (round(np.mean(metrics[-1]["k"]) / config["density"])
                                     if "k" in metrics[-1] else None)
    workers = metrics[0]["workers"]
    row["iterations"] = len(metrics)
    row["epochs"] = round(evals[-1]["epoch"], 2) if evals else None
    row["test_acc"] = evals[-1]["test_acc"] if evals else None
    row["best_acc"] = max(e["test_acc"] for e in evals) if evals else None
    row["curve"] = [[e["epoch"], round(e["test_acc"], 4)] for e in evals]
    train_s = metrics[-1]["time_s"]
    row["iterations_per_s"] = round(len(metrics) / train_s, 2) if train_s else None
    row["sent_bytes_per_iteration"] = sent_per_iteration(metrics)
    row["sent_over_allreduce"] = row["sent_bytes_per_iteration"] / \
        dense_allreduce_bytes(workers, numel) if numel else 1.0
    if config.get("density", 1) < 1:  # as the sweep table: every round, warm-up included
        row["union_k_mean"] = float(union_over_k(metrics).mean())
    return row


def ended(row: dict) -> str:
    """finished, stopped (a signal: a time limit, or the session ended), failed (exit status),
    or no summary yet (running, or killed before it could write one)."""
    if row["finished"]:
        return "finished"
    if row["exit"] is None:
        return "no summary (running, or killed)"
    return "stopped" if row["exit"] in STOPPED else f"failed (exit {row['exit']})"


def reached_table(rows: list[dict]) -> str:
    """A markdown table of ``reached`` rows."""
    pct = lambda v: "—" if v is None else f"{100 * v:.2f}"  # noqa: E731
    return md_table(
        ["run", "seed", "ended", "epochs (last evaluation)", "iterations", "test acc %",
         "best %", "union/k", "sent / allreduce %", "it/s"],
        [[r["run"], r["seed"], ended(r), r.get("epochs"), r.get("iterations"),
          pct(r.get("test_acc")), pct(r.get("best_acc")),
          f"{r['union_k_mean']:.2f}" if "union_k_mean" in r else "—",
          pct(r.get("sent_over_allreduce")), r.get("iterations_per_s")] for r in rows])


def run_paths(sweep: str, name: str, args: list[str], seed: int, data_dir: str | None):
    """(run directory, psparse-launch command, identity) of one run of a sweep. The run's
    identity is its arguments, not where the checkout lives (sweeps are often run from a
    separate worktree so that editing the code does not change a running sweep)."""
    out = ROOT / "runs" / sweep / f"{name}-s{seed}"
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet", *args,
           "--seed", str(seed)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    return out, cmd, cmd[6:]


def run_one(sweep: str, name: str, args: list[str], seed: int, data_dir: str | None,
            target: float, progress: bool = False, label: str = "") -> dict:
    """One run of a sweep: reused when finished, resumed from its newest checkpoint when it
    was stopped part-way, else started; its row of figures.

    The run's identity is its arguments (``RunCache``: started.json before the launcher starts,
    command.json once it has ended, whether the run succeeded or failed); a finished run of
    these arguments is reused, by whichever code made it (the table names it). One only
    started, with a checkpoint that the server and every worker saved (``--checkpoint-every``)
    by this code, is continued with ``psparse-launch --resume``; otherwise it starts over. A
    launcher that was interrupted or killed stops the sweep (SystemExit) without marking the
    run ended, so the next call resumes it."""
    out, cmd, identity = run_paths(sweep, name, args, seed, data_dir)
    cache = RunCache(out, identity)
    if not cache.finished():
        launch(sweep, f"{name} seed {seed}", label, cache, cmd, progress)
    return run_row(out, name, seed, target)


def launch(sweep: str, run: str, label: str, cache: RunCache, cmd: list[str],
           progress: bool) -> None:
    """Run (or resume) one run of a sweep to its end. ``run`` names it in the messages,
    ``label`` (its place in the sweep, "3/8 ") goes before the name in those of progress."""
    out, what = cache.dir.path, f"{label}{run}"
    t = time.perf_counter()
    saved = None
    if cache.started() and cache.dir.json("config.json") is not None:
        config = cache.dir.config()
        point = checkpoint.resume_point(out, config["workers"], config.get("servers") or 1)
        saved = point.iteration if point is not None else None
        made_by = cache.dir.code_id()
        if saved is not None and made_by != provenance()["code_id"]:
            # one run, one code: a table states which code made its runs
            print(f"[{sweep}] {what}: its checkpoint was made by other code ({made_by}); "
                  "starting over", flush=True)
            saved = None
    if saved is not None:
        print(f"[{sweep}] {what}: resuming at iteration {saved} ...", flush=True)
        argv = [sys.executable, "-m", "psparse.launch", "--resume", str(out)]
        argv += [] if progress else ["--quiet"]
    else:
        print(f"[{sweep}] {what} ...", flush=True)
        argv = [c for c in cmd if c != "--quiet"] if progress else cmd
        cache.start(fresh=True)  # starting over: none of the stopped attempt's files
    r = subprocess.run(argv, cwd=ROOT)
    if r.returncode == INTERRUPTED or r.returncode < 0:
        raise SystemExit(f"[{sweep}] {run} stopped (exit {r.returncode}); run the same "
                         "command again to resume it from its last checkpoint")
    cache.finish()
    if r.returncode != 0:
        print(f"[{sweep}] {run} FAILED (exit {r.returncode}); logs in {out}", flush=True)
    print(f"[{sweep}] {what} done in {time.perf_counter() - t:.0f} s", flush=True)


def run_row(out: Path, name: str, seed: int, target: float) -> dict:
    """The sweep table's figures of one finished run (or why it has none)."""
    run = RunDir(out)
    summary = run.summary()
    where = str(out.relative_to(ROOT))
    if summary is None:
        return {"run": name, "seed": seed, "failed": "no summary (see logs)", "dir": where}
    if summary["status"] != "ok":
        return {"run": name, "seed": seed, "failed": summary["error"], "dir": where}
    metrics, evals = run.metrics(), run.evals()
    workers, numel = summary["world_size"], summary["numel"]
    row = {"run": name, "seed": seed, "test_acc": summary["test_acc"],
           "best_acc": max(e["test_acc"] for e in evals),
           "epochs_to_near_best": epochs_to_near_best(evals),
           "broadcast_mb": summary["broadcast_mb"], "upload_mb": summary["upload_mb"],
           "iterations_per_s": summary["iterations_per_s"],
           "ms_per_iteration": 1000 * summary["wall_s"] / summary["iterations"],
           "target_acc": target,
           # wall time at the first evaluation that reached the target (None: never reached)
           "time_to_target_s": next((e["time_s"] for e in evals if e["test_acc"] >= target),
                                    None),
           "iterations": summary["iterations"], "workers": workers, "numel": numel,
           # bytes on the wire per iteration, all processes together: the workers' pushes
           # (two-phase policies' proposals included) and the server's broadcast (vote's and
           # cltk's index broadcast included), or a baseline's ring traffic; over what a dense
           # ring allreduce of the same model sends (ALLREDUCE_DEFINITION)
           "sent_bytes_per_iteration": sent_per_iteration(metrics),
           "allreduce_bytes_per_iteration": dense_allreduce_bytes(workers, numel),
           "code": run.code_id(), "dir": where}
    row["sent_over_allreduce"] = row["sent_bytes_per_iteration"] / \
        row["allreduce_bytes_per_iteration"]
    if "baseline" in summary:  # DDP: dense ring allreduce, no union; bytes = ring traffic
        row.update(baseline=summary["baseline"], union_k_mean=1.0, union_k_p95=1.0,
                   k_mean=float(summary["numel"]))
        return row
    ratio = union_over_k(metrics)
    row.update(union_k_mean=float(ratio.mean()), union_k_p95=float(np.percentile(ratio, 95)),
               k_mean=float(np.mean([np.mean(m["k"]) for m in metrics])))
    return row


ALLREDUCE_DEFINITION = (
    "up + bcast, % of allreduce: the bytes all workers push (proposals included) plus the "
    "bytes the server broadcasts (index broadcasts included), per iteration, as a share of the "
    "bytes a dense ring allreduce of the same model sends per iteration, all workers together: "
    "N workers x 2(N-1)/N x numel x 4 B (reduce-scatter and all-gather, float32; the same "
    "count as the DDP baseline's allreduce_bytes, so DDP is 100%). psparse's counts include "
    "message headers, the ring's do not; dense exchange through the server is 2N/(2(N-1)) = "
    "114% at N = 8.")


def dense_allreduce_bytes(workers: int, numel: int) -> float:
    """Bytes a dense float32 ring allreduce sends per iteration, all workers together:
    each of N workers sends 2(N-1)/N x numel x 4 B (reduce-scatter, then all-gather)."""
    return workers * 2 * (workers - 1) / workers * numel * 4


def table(rows: list[dict]) -> str:
    """The sweep's table: one line per run, means over its seeds; "±" is the sample standard
    deviation over seeds (ddof=1); the definition of the bytes ratio below it."""
    target = next((r["target_acc"] for r in rows if "target_acc" in r), 0.98)
    header = ["run", "seeds", "final acc % (± sample SD)", "best acc %", "union/k mean",
              "union/k p95", "broadcast MB", "upload MB", "up + bcast, % of allreduce", "mean k",
              "ms/iter", f"s to {100 * target:g}%", "epochs to within 1 pt of best"]
    lines = []
    for name, rs in by_run(rows).items():
        failed = [r for r in rs if "failed" in r]
        if failed:
            lines.append([name, len(rs), f"failed: {failed[0]['failed'][:90]}"] + [""] * 10)
            continue
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        to_target = (f"{np.mean(reached):.0f}" if len(reached) == len(rs) else
                     f"not reached ({len(rs) - len(reached)} of {len(rs)})")
        # rows made before these columns existed do not have them
        epochs = [r.get("epochs_to_near_best") for r in rs]
        near_best = f"{np.mean(epochs):.1f}" if None not in epochs else "—"
        ratio = f"{100 * mean_of(rs, 'sent_over_allreduce'):.2f}" \
            if all("sent_over_allreduce" in r for r in rs) else "—"
        lines.append([name, len(rs), mean_sd([100 * r["test_acc"] for r in rs]),
                      f"{100 * mean_of(rs, 'best_acc'):.2f}",
                      f"{mean_of(rs, 'union_k_mean'):.2f}", f"{mean_of(rs, 'union_k_p95'):.2f}",
                      f"{mean_of(rs, 'broadcast_mb'):.1f}", f"{mean_of(rs, 'upload_mb'):.1f}",
                      ratio, f"{mean_of(rs, 'k_mean'):.0f}",
                      f"{mean_of(rs, 'ms_per_iteration'):.1f}", to_target, near_best])
    return md_table(header, lines) + "\n\n" + ALLREDUCE_DEFINITION + "\n\n" + made_by(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", choices=sorted(SWEEPS))
    p.add_argument("--only", default=None, help="comma-separated run names of the sweep")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds for every run (default: the sweep's seeds per "
                        "run, else 0)")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    p.add_argument("--stem", default=None,
                   help="name of the results files (default: the sweep, plus the --only runs)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the psparse-launch arguments of every run and stop")
    p.add_argument("--report", action="store_true",
                   help="start no run: the table and figures of the runs already finished "
                        "(while the sweep goes on elsewhere), naming those that are not, and "
                        "how far each started one got (epochs, last and best accuracy; also in "
                        "STEM-unfinished.json)")
    args = p.parse_args(argv)
    sweep = SWEEPS[args.sweep]
    names = args.only.split(",") if args.only else list(sweep["runs"])
    unknown = [n for n in names if n not in sweep["runs"]]
    if unknown:
        p.error(f"unknown run(s) {unknown}; the sweep has {list(sweep['runs'])}")
    if args.seeds is not None:
        seeds = {name: [int(s) for s in args.seeds.split(",")] for name in names}
    else:
        seeds = {name: sweep.get("seeds", {}).get(name, [0]) for name in names}
    # seed-major, as before: every run's seed 0 first, so a stopped sweep has one of each
    plan = [(name, seed) for seed in sorted({s for v in seeds.values() for s in v})
            for name in names if seed in seeds[name]]
    if args.dry_run:
        for name in names:
            print(f"{name} (seeds {','.join(map(str, seeds[name]))}): psparse-launch "
                  f"{' '.join(sweep['base'] + sweep['runs'][name])}")
        return 0
    pending, unfinished = [], []  # --report: the runs not finished yet, how far they got
    if args.report:
        pending, unfinished = not_finished(args.sweep, plan, args.data_dir)
        plan = [(name, seed) for name, seed in plan if f"{name}-s{seed}" not in pending]
        if not plan and not unfinished:
            print(f"[{args.sweep}] no run is finished or started yet")
            return 1
    rows = []
    for i, (name, seed) in enumerate(plan):
        rows.append(run_one(args.sweep, name, sweep["base"] + sweep["runs"][name], seed,
                            args.data_dir, sweep.get("target", 0.98),
                            progress=sweep.get("progress", False),
                            label=f"{i + 1}/{len(plan)} "))
    stem = args.stem or (args.sweep if not args.only else f"{args.sweep}-{'-'.join(names)}")
    if args.report and pending and not args.stem:
        stem += "-partial"  # never over the finished sweep's own table
    write_results(args.sweep, stem, rows, pending, unfinished)
    return 0


def not_finished(sweep: str, plan: list[tuple[str, int]], data_dir: str | None):
    """--report: the runs of the plan not finished yet ("NAME-sSEED"), and how far each one
    started with these arguments got (``reached``)."""
    pending, unfinished = [], []
    for name, seed in plan:
        out, _, identity = run_paths(sweep, name, SWEEPS[sweep]["base"] +
                                     SWEEPS[sweep]["runs"][name], seed, data_dir)
        cache = RunCache(out, identity)
        if cache.finished():
            continue
        pending.append(f"{name}-s{seed}")
        # this run's, not one made with other arguments
        if (out / "metrics.jsonl").is_file() and cache.started():
            unfinished.append(reached(out, name, seed, exit_status(out)))
            # a summary without command.json: the launcher did not end (killed after it)
            unfinished[-1]["finished"] = False
    return pending, unfinished


def write_results(sweep: str, stem: str, rows: list[dict], pending: list[str],
                  unfinished: list[dict]) -> None:
    """results/STEM.json and STEM.md (and STEM-unfinished.json), and the sweep's figures."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    text = table(rows) if rows else "No run is finished yet."
    if pending:
        text += f"\n\nNot finished yet ({len(pending)}): {', '.join(pending)}."
    (RESULTS / f"{stem}-unfinished.json").unlink(missing_ok=True)  # never a stale one
    if unfinished:
        (RESULTS / f"{stem}-unfinished.json").write_text(json.dumps(unfinished, indent=1))
        text += ("\n\nHow far the unfinished runs got (their last evaluation; what was reached, "
                 "not a projection):\n\n" + reached_table(unfinished) + "\n\n" +
                 made_by(unfinished))
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    if not pending and stem == sweep:
        # the whole sweep's table now stands: an earlier --report's snapshot would contradict it
        for stale in RESULTS.glob(f"{stem}-partial*"):
            stale.unlink()
    print(text)
    if rows:
        for path in figures.build(sweep, stem, rows):
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
