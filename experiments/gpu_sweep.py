"""Runs of a sweep side by side on one GPU machine, stopped at a time limit; what each reached.

A device lease is minutes long and the machine starts bare, so this does not resume or reuse
runs as ``experiments.run`` does: it starts every chosen run of the sweep at once (each its own
launcher, server and workers, all sharing the GPU), with ``--device cuda --server-device cuda``
added and ``--checkpoint-every`` dropped (a bare machine cannot resume them). At ``--seconds``
it stops the runs still going (SIGINT: the launcher stops its processes and exits 130; those
not stopped within 30 s in all are killed). It then writes to ``--out``:

* ``gpu_sweep.md`` and ``gpu_sweep.json``: per run, the epochs and iterations reached, the last
  and best test accuracy of the per-epoch evaluations, union/k, bytes per iteration over a dense
  ring allreduce's (as in ``experiments.run``), training iterations per second, and whether it
  finished or was stopped;
* ``gpu_sweep-runs.tar.gz``: each run's directory (config, metrics, evaluations, summary, logs;
  no checkpoints), to unpack under ``runs/`` for ``psparse-report``.

Run directories are ``runs/gpu-SWEEP/RUN-sSEED`` (emptied before each start). Exits 1 if a run
failed or recorded no iteration. ``--report DIR`` (no sweep needed) writes the table again from
unpacked run directories.

Report what was reached: a stopped run's figures are those of its last evaluation, not a
projection. Usually called through ``experiments/gpu_sweep.sh``, which readies a bare machine.

    python -m experiments.gpu_sweep resnet20-cifar10-long --only dense,topk-d0.01 --seconds 480
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from experiments.run import SWEEPS, dense_allreduce_bytes, sent_per_iteration, union_over_k

CUDA = ["--device", "cuda", "--server-device", "cuda"]
STOPPED = (130, -signal.SIGKILL, -signal.SIGINT)  # exit statuses of a run stopped at the limit
STOP_GRACE_S = 30  # how long the stopped launchers get, all together, to stop their processes


def drop_option(args: list[str], name: str) -> list[str]:
    """args without ``name`` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        else:
            out.append(a)
    return out


def reached(run_dir: Path, name: str, seed: int, exit_code: int | None) -> dict:
    """One run's row from its run directory, whether it finished or was stopped."""
    row = {"run": name, "seed": seed, "exit": exit_code, "dir": run_dir.name}
    lines = lambda f: [json.loads(x) for x in (run_dir / f).read_text().splitlines()  # noqa: E731
                       if x.strip()] if (run_dir / f).is_file() else []
    metrics, evals = lines("metrics.jsonl"), lines("eval.jsonl")
    config = json.loads((run_dir / "config.json").read_text()) \
        if (run_dir / "config.json").is_file() else {}
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").is_file() else None
    row["finished"] = summary is not None and exit_code == 0
    row["code"] = config.get("provenance", {}).get("code_id")
    if not metrics:
        row["failed"] = "no iteration recorded (see the launcher log)"
        return row
    summary = summary or {}
    # the model's size: the summary's (written also by a stopped run's server), else from k
    numel = summary.get("numel") or round(np.mean(metrics[-1]["k"]) / config["density"])
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
        dense_allreduce_bytes(workers, numel)
    if config.get("density", 1) < 1:  # as experiments.run: over every round, warm-up included
        row["union_k_mean"] = float(union_over_k(metrics).mean())
    return row


def ended(row: dict) -> str:
    """finished, stopped (at the time limit: exit 130, or killed), failed (exit status), or
    unknown (read back by --report from a run that left no summary)."""
    if row["finished"]:
        return "finished"
    if row["exit"] is None:
        return "ended without a summary"
    return "stopped" if row["exit"] in STOPPED else f"failed (exit {row['exit']})"


def write_table(rows: list[dict], out: Path) -> str:
    """gpu_sweep.json and gpu_sweep.md in ``out``; the markdown table."""
    (out / "gpu_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| run | seed | ended | epochs (last evaluation) | iterations | test acc % | best % "
             "| union/k | sent / allreduce % | it/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: "—" if v is None else f"{100 * v:.2f}"  # noqa: E731
    for r in rows:
        union = f"{r['union_k_mean']:.2f}" if "union_k_mean" in r else "—"
        lines.append(f"| {r['run']} | {r['seed']} | {ended(r)}"
                     f" | {r.get('epochs')} | {r.get('iterations')} | {pct(r.get('test_acc'))} "
                     f"| {pct(r.get('best_acc'))} | {union} | "
                     f"{pct(r.get('sent_over_allreduce'))} | {r.get('iterations_per_s')} |")
    text = "\n".join(lines)
    (out / "gpu_sweep.md").write_text(text + "\n")
    return text


def report(runs: Path, out: Path) -> str:
    """The table again from unpacked run directories (gpu_sweep-runs.tar.gz), after a fix to
    how rows are read: the exit status is read back from each summary (a stopped run's says
    'terminated by signal')."""
    rows = []
    for run_dir in sorted(d for d in runs.iterdir() if (d / "config.json").is_file()):
        name, _, seed = run_dir.name.rpartition("-s")
        if not (name and seed.isdigit()):
            continue  # not a run directory of a sweep (NAME-sSEED)
        summary = json.loads((run_dir / "summary.json").read_text()) \
            if (run_dir / "summary.json").is_file() else None
        code = None if summary is None else 0 if summary.get("status") == "ok" else \
            130 if "signal" in str(summary.get("error")) else 1
        rows.append(reached(run_dir, name, int(seed), code))
    return write_table(rows, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", nargs="?", choices=sorted(SWEEPS),
                   help="the sweep (experiments/run.py) whose runs to start; not with --report")
    p.add_argument("--only", default="", help="comma-separated run names of the sweep")
    p.add_argument("--seeds", default="0", help="comma-separated seeds for every run (default 0)")
    p.add_argument("--seconds", type=float, default=None,
                   help="time limit for all runs together; runs still going are stopped then")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="folder for the table and the runs' archive (default: $OUT, else "
                        "runs/gpu-SWEEP)")
    p.add_argument("--extra", default="", help="more psparse-launch arguments for every run "
                                                "(one string, split on spaces)")
    p.add_argument("--report", metavar="RUNS", default=None,
                   help="run nothing: write the table again from RUNS, a folder of unpacked run "
                        "directories (gpu_sweep-runs.tar.gz), into --out")
    args = p.parse_args(argv)
    if args.report:
        out = Path(args.out or args.report)
        out.mkdir(parents=True, exist_ok=True)
        print(report(Path(args.report), out))
        return 0
    if args.sweep is None or not args.only or args.seconds is None:
        p.error("a sweep, --only and --seconds are needed (unless --report)")
    sweep = SWEEPS[args.sweep]
    names = args.only.split(",")
    unknown = [n for n in names if n not in sweep["runs"]]
    if unknown:
        p.error(f"unknown run(s) {unknown}; the sweep has {list(sweep['runs'])}")
    out = Path(args.out or f"runs/gpu-{args.sweep}")
    out.mkdir(parents=True, exist_ok=True)
    work = Path("runs") / f"gpu-{args.sweep}"
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.seconds
    procs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in names:
            run_dir = work / f"{name}-s{seed}"
            run_args = drop_option(sweep["base"] + sweep["runs"][name], "--checkpoint-every")
            run_args = drop_option(drop_option(run_args, "--device"), "--server-device")
            cmd = [sys.executable, "-m", "psparse.launch", "--out", str(run_dir), *run_args,
                   *CUDA, *args.extra.split(), "--seed", str(seed)]
            shutil.rmtree(run_dir, ignore_errors=True)  # never resumed: no stale files
            run_dir.mkdir(parents=True)
            log = open(run_dir / "launcher.log", "w")
            print(f"[gpu-sweep] {name} seed {seed}: {' '.join(cmd[3:])}", flush=True)
            procs[(name, seed)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                                   run_dir)
    last_note = time.monotonic()
    while any(proc.poll() is None for proc, _ in procs.values()) and time.monotonic() < deadline:
        time.sleep(2)
        if time.monotonic() - last_note >= 30:
            last_note = time.monotonic()
            state = []
            for (name, seed), (proc, run_dir) in procs.items():
                evals = (run_dir / "eval.jsonl").read_text().splitlines() \
                    if (run_dir / "eval.jsonl").is_file() else []
                e = json.loads(evals[-1]) if evals else None
                state.append(f"{name}-s{seed} " + (f"epoch {e['epoch']:.0f} acc "
                                                   f"{e['test_acc']:.2%}" if e else "starting")
                             + ("" if proc.poll() is None else f" (exit {proc.returncode})"))
            print(f"[gpu-sweep] {deadline - time.monotonic():.0f} s left: " + "; ".join(state),
                  flush=True)
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    stop_by = time.monotonic() + STOP_GRACE_S
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=max(0.1, stop_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    rows = [reached(run_dir, name, seed, proc.returncode)
            for (name, seed), (proc, run_dir) in procs.items()]
    text = write_table(rows, out)
    with tarfile.open(out / "gpu_sweep-runs.tar.gz", "w:gz") as tar:
        for _, run_dir in procs.values():
            tar.add(run_dir, arcname=run_dir.name,
                    filter=lambda info: None if "checkpoint" in info.name else info)
    print(text)
    # 1 when a run failed, or recorded no iteration: a stopped run is what the limit is for
    return 0 if all(r.get("iterations") and not ended(r).startswith("failed")
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
