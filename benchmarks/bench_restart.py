"""How long ``psparse-launch --max-restarts`` takes to recover from a killed worker.

One run per case. The benchmark kills rank 1 with SIGKILL just after the first checkpoint it
asks for, then reads the recovery timeline from ``summary.json``'s ``attempts`` and from its
own polling of ``metrics.jsonl``:

- detection: from the kill until the launcher notices (the server sees the closed connection
  and ends the run; the supervisor reaps the processes);
- stop: from then until the other processes have stopped;
- back-off: from then until the new attempt starts (``--restart-backoff``);
- reload: from the new attempt's start until its first new round is recorded: processes
  started, checkpoints loaded, workers registered.

Usage: python benchmarks/bench_restart.py [--quick]. ``--quick`` runs LeNet only; the default
also runs a 25M-parameter synthetic model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psparse.launch.processes import writer_of

REPO = Path(__file__).resolve().parent.parent
CASES = {  # name -> (launcher flags, checkpoint interval, rounds to wait for before the kill)
    "lenet": (["--workers", "2", "--model", "lenet", "--dataset", "mnist", "--iterations", "120",
               "--eval-every", "0"], 40, 50),
    "synthetic-25M": (["--workers", "2", "--model", "synthetic", "--model-arg", "numel=25M",
                       "--dataset", "digits", "--density", "0.001", "--iterations", "24",
                       "--eval-every", "0"], 8, 10),
}


def rows(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def measure(name: str, flags: list[str], every: int, kill_after: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
            "--checkpoint-every", str(every), "--max-restarts", "1", "--restart-backoff", "1",
            *flags]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = out / "metrics.jsonl"
    while rows(metrics) < kill_after or not (out / "checkpoint" / f"server-{every}.pt").is_file():
        if proc.poll() is not None:
            sys.exit(f"{name}: the run ended before the kill:\n{proc.communicate()[0]}")
        time.sleep(0.01)
    pid = writer_of(out / "logs" / "rank-1.log")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    first_round_at, resumed_at, server_log = None, None, out / "logs" / "server.log"
    while proc.poll() is None and first_round_at is None:
        if resumed_at is None and (out / "logs" / "attempt-0").is_dir():
            # the new server truncates metrics.jsonl to its checkpoint before it says this
            text = server_log.read_text() if server_log.is_file() else ""
            if "resumed at iteration " in text:
                resumed_at = int(text.split("resumed at iteration ")[1].split()[0])
        if resumed_at is not None and rows(metrics) > resumed_at:
            first_round_at = time.time()
        time.sleep(0.005)
    output = proc.communicate()[0]
    if proc.returncode != 0 or first_round_at is None:
        sys.exit(f"{name}: the restarted run failed, or its first round was not seen:\n{output}")
    failed, again = json.loads((out / "summary.json").read_text())["attempts"]
    return {
        "case": name, "resumed_from": again["resumed_from"],
        "detection_s": failed["noticed_at"] - killed_at,
        "stop_s": failed["stopped_at"] - failed["noticed_at"],
        "backoff_s": again["started_at"] - failed["stopped_at"],
        "reload_s": first_round_at - again["started_at"],
        "total_s": first_round_at - killed_at,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="LeNet only")
    args = ap.parse_args(argv)
    cases = ["lenet"] if args.quick else list(CASES)
    print(f"{'case':<16}{'detection':>10}{'stop':>8}{'back-off':>10}{'reload':>9}{'total':>8}"
          "   (seconds, from the kill of rank 1)")
    for name in cases:
        flags, every, kill_after = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(name, flags, every, kill_after, Path(tmp) / name)
        print(f"{name:<16}{r['detection_s']:>10.2f}{r['stop_s']:>8.2f}{r['backoff_s']:>10.2f}"
              f"{r['reload_s']:>9.2f}{r['total_s']:>8.2f}   resumed from {r['resumed_from']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
