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

from experiments.harness import RunDir
from experiments.run import ended, exit_status, reached, reached_table
from experiments.sweeps import SWEEPS

CUDA = ["--device", "cuda", "--server-device", "cuda"]
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


def write_table(rows: list[dict], out: Path) -> str:
    """gpu_sweep.json and gpu_sweep.md in ``out``; the markdown table."""
    (out / "gpu_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = reached_table(rows)
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
        rows.append(reached(run_dir, name, int(seed), exit_status(run_dir)))
    return write_table(rows, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", nargs="?", choices=sorted(SWEEPS),
                   help="the sweep (experiments/sweeps.py) whose runs to start; not with --report")
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
                evals = RunDir(run_dir).evals()  # complete lines: the run is writing them
                e = evals[-1] if evals else None
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
