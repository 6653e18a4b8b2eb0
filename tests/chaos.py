"""Chaos over a self-healing run: random SIGKILLs of its workers, its server (also while the
run restarts or writes a checkpoint) and, in the soak, the launcher itself; the run must end
as an uninterrupted one: the same metrics and evaluations (timing aside) and the same weights.

    .venv/bin/python tests/chaos.py --kills 15 --launcher-kills 2 --iterations 8000   # make soak

tests/test_chaos.py runs a short one in ``make test``. A fault is drawn per kill (seeded):
the victim (a worker rank or the server) and the moment: ``training`` (a random delay once the
run has recorded a new round), ``checkpoint`` (as soon as a checkpoint's temporary file
appears) or ``restart`` (as soon as a restarted attempt's process is up, before its first
round). A launcher kill (SIGKILL of psparse-launch and every process of the run) is followed by
``psparse-launch --resume``, as a user would do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from psparse import checkpoint  # noqa: E402
from psparse.launch.processes import writer_of  # noqa: E402

WORKERS = 2


def run_args(iterations: int, every: int) -> list[str]:
    return ["--workers", str(WORKERS), "--model", "mlp", "--dataset", "digits", "--iterations",
            str(iterations), "--eval-every", str(every), "--checkpoint-every", str(every),
            "--seed", "7", "--quiet"]


def launcher(out: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), *args]
    return subprocess.Popen(cmd, cwd=HERE.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def records(path: Path) -> list[dict]:
    timing = ("round_s", "time_s")
    return [{k: v for k, v in json.loads(line).items() if k not in timing}
            for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll ``condition()`` until true; False when the launcher ended first (or time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def kill_one(out: Path, proc: subprocess.Popen, rng: random.Random, say) -> str | None:
    """One drawn fault; what was killed (None: the run ended before the moment came)."""
    victim = rng.choice([f"rank-{r}" for r in range(WORKERS)] + ["server"])
    moment = rng.choice(["training", "training", "checkpoint", "restart"])
    log = out / "logs" / f"{victim}.log"
    start = rows(out)
    if moment == "checkpoint":
        folder = out / "checkpoint"
        ok = wait_for(lambda: folder.is_dir() and any(p.name.endswith(".tmp")
                                                      for p in folder.iterdir()), proc)
    elif moment == "restart":  # the victim's new process, as soon as it is up
        ok = wait_for(lambda: writer_of(log) is not None, proc)
    else:
        ok = wait_for(lambda: rows(out) > start, proc)
        time.sleep(rng.uniform(0.0, 0.3))
    pid = writer_of(log) if ok else None
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    say(f"chaos: SIGKILL {victim} (pid {pid}) at {moment}, {rows(out)} rounds recorded")
    # the next fault waits for the launcher's restart: a new process writing the victim's log
    wait_for(lambda: writer_of(log) not in (None, pid), proc, timeout=60)
    return victim


def kill_launcher(proc: subprocess.Popen, out: Path, rng: random.Random, say) -> None:
    """SIGKILL the launcher and its whole run (its process group) at a random round once a
    checkpoint is complete (a user's --resume needs one: without, they start again)."""
    target = rows(out) + rng.randint(1, 20)  # drawn once: a seed gives the same faults
    if wait_for(lambda: rows(out) > target and
                checkpoint.resume_point(out, WORKERS) is not None, proc):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        say(f"chaos: SIGKILL the launcher and its run at {rows(out)} rounds recorded")


def chaos_run(out: Path, iterations: int, every: int, kills: int, launcher_kills: int = 0,
              seed: int = 0, say=print) -> dict:
    """The run under chaos; its summary. Raises AssertionError when it did not end well."""
    out = Path(out).resolve()  # writer_of compares absolute paths (/proc/PID/fd/1)
    rng = random.Random(seed)
    args = run_args(iterations, every) + ["--max-restarts", str(kills + 2),
                                          "--restart-backoff", "0.2"]
    proc = launcher(out, args)
    done = 0
    plan = ["process"] * kills + ["launcher"] * launcher_kills
    rng.shuffle(plan)
    for fault in plan:
        if fault == "launcher":
            kill_launcher(proc, out, rng, say)
            if proc.poll() is not None and proc.returncode < 0:  # killed: resume it
                proc = launcher(out, ["--resume", str(out), "--quiet", "--max-restarts",
                                      str(kills + 2), "--restart-backoff", "0.2"])
                done += 1
        elif kill_one(out, proc, rng, say):
            done += 1
    output = proc.communicate(timeout=1200)[0]
    assert proc.returncode == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    say(f"chaos: {done} of {len(plan)} faults happened before the run ended; "
        f"{summary.get('restarts', 0)} restarts in the last launch; ok")
    summary["faults"] = done
    return summary


def assert_same(run: Path, clean: Path) -> None:
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert records(run / name) == records(clean / name), name
    for r in range(WORKERS):
        assert json.loads((run / f"rank-{r}.json").read_text())["checksum"] == \
            json.loads((clean / f"rank-{r}.json").read_text())["checksum"], f"rank {r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=15, help="process kills (default 15)")
    p.add_argument("--launcher-kills", type=int, default=2,
                   help="launcher kills, each followed by --resume (default 2)")
    p.add_argument("--iterations", type=int, default=8000)
    p.add_argument("--every", type=int, default=100, help="checkpoint and evaluation interval")
    p.add_argument("--seed", type=int, default=0, help="the faults' seed")
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = p.parse_args(argv)
    clean, chaotic = args.out / "clean", args.out / "chaos"
    for d in (clean, chaotic):
        if d.exists():
            subprocess.run(["rm", "-rf", str(d)], check=True)
    t = time.perf_counter()
    proc = launcher(clean, run_args(args.iterations, args.every))
    output = proc.communicate(timeout=1200)[0]
    if proc.returncode != 0:
        raise SystemExit(f"the clean run failed:\n{output}")
    print(f"clean run: {time.perf_counter() - t:.0f} s", flush=True)
    summary = chaos_run(chaotic, args.iterations, args.every, args.kills, args.launcher_kills,
                        args.seed, say=lambda m: print(m, flush=True))
    assert_same(chaotic, clean)
    planned = args.kills + args.launcher_kills
    if summary["faults"] < 0.8 * planned:
        raise SystemExit(f"only {summary['faults']} of {planned} faults happened: the run ended "
                         "first; give it more --iterations")
    print(f"soak: {args.kills} process kills and {args.launcher_kills} launcher kills; metrics, "
          "evaluations and every rank's weights identical to the clean run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
