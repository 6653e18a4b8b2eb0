"""--max-restarts on real processes: a killed worker, server or server shard, and a script's
data error, each restarted from the newest checkpoint and finishing identical to a run that was
never interrupted; a fault that repeats stops the restarts with the whole history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import read_jsonl, run_launch, start_launch

from psparse.launch.processes import writer_of

HERE = Path(__file__).resolve().parent
RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "400",
       "--eval-every", "50", "--checkpoint-every", "100", "--seed", "4", "--quiet"]
SCRIPT_RUN = ["--workers", "2", "--checkpoint-every", "20", "--quiet", "--restart-backoff",
              "0.5", str(HERE / "faulty_train.py"), "--iterations", "60"]


def launch(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_launch("--out", str(out), *args, timeout=timeout)


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


def assert_identical(run: Path, clean: Path, workers: int, metrics: bool = True) -> None:
    """The same records (one per iteration / evaluation, none doubled) and final weights."""
    for name in ("metrics.jsonl", "eval.jsonl") if metrics else ("eval.jsonl",):
        assert without_timing(read_jsonl(run / name)) == \
            without_timing(read_jsonl(clean / name)), name
    for r in range(workers):
        assert json.loads((run / f"rank-{r}.json").read_text())["checksum"] == \
            json.loads((clean / f"rank-{r}.json").read_text())["checksum"], f"rank {r}"


def wait_until_saved(proc: subprocess.Popen, saved: list[Path], victim: Path | None = None):
    """Once every file of ``saved`` exists (the launcher ``proc`` must not end before): the
    pid of the live process whose log is ``victim``, when one is named."""
    deadline = time.monotonic() + 120
    while not all(f.is_file() for f in saved) or \
            (victim is not None and (pid := writer_of(victim)) is None):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    return pid if victim is not None else None


def kill_once_saved(proc: subprocess.Popen, out: Path, saved: list[Path], victim: str) -> None:
    """SIGKILL the run's process ``victim`` (its log: logs/VICTIM.log) once every file of
    ``saved`` exists."""
    os.kill(wait_until_saved(proc, saved, out / "logs" / f"{victim}.log"), signal.SIGKILL)


def restarted_once(out: Path, output: str) -> list[dict]:
    """The run restarted once and then ended well: its attempts (the failed, the resumed)."""
    assert "psparse-launch: restart 1 of" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["restarts"] == 1
    return summary["attempts"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "run"
    r = launch(out, *RUN)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.mark.parametrize("victim, extra", [pytest.param("rank-1", [], marks=pytest.mark.long),
                                           ("server", []),
                                           pytest.param("server-1", ["--servers", "2"],
                                                        marks=pytest.mark.long)],
                         ids=["worker", "server", "server-shard"])
def test_a_killed_process_restarts_the_run_which_ends_as_the_clean_one(tmp_path, clean_run,
                                                                       victim, extra):
    out = tmp_path / "run"
    proc = start_launch("--out", str(out), *RUN, *extra,
                        "--max-restarts", "2", "--restart-backoff", "0.5")
    servers = [out] if not extra else [out / "shard-0", out / "shard-1"]
    saved = [d / "checkpoint" / "server-200.pt" for d in servers] + \
        [out / "checkpoint" / f"rank-{r}-200.pt" for r in range(3)]  # all of iteration 200
    kill_once_saved(proc, out, saved, victim)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    failed, resumed = restarted_once(out, output)
    assert failed["process"] == victim and failed["process_exit_code"] == -signal.SIGKILL
    assert resumed["resumed_from"] in (200, 300) and resumed["exit_code"] == 0
    assert (out / "logs" / "attempt-0" / f"{victim}.log").is_file()
    # a sharded run's metrics carry the shards' own byte counts: compare evaluations and weights
    assert_identical(out, clean_run, 3, metrics=not extra)
    assert len(read_jsonl(out / "metrics.jsonl")) == 400


@pytest.mark.long
def test_a_data_error_restarts_a_script_and_it_ends_as_the_clean_one(tmp_path):
    clean = launch(tmp_path / "clean", *SCRIPT_RUN)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    out = tmp_path / "run"
    r = launch(out, "--max-restarts", "2", *SCRIPT_RUN, "--fail-at", "45")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["restarts"] == 1
    failed = summary["attempts"][0]
    assert failed["process"] == "rank-1" and "data error at iteration 45" in failed["error"]
    assert summary["attempts"][1]["resumed_from"] == 40
    assert_identical(out, tmp_path / "clean", 2)


@pytest.mark.long
def test_the_same_fault_again_stops_the_restarts(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--max-restarts", "3", *SCRIPT_RUN, "--fail-at", "25", "--fail-times", "9")
    assert r.returncode != 0
    assert "failed again with the same cause at the same iteration" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["restarts"] == 1
    assert [a["resumed_from"] for a in summary["attempts"]] == [None, 20]
    assert all("data error at iteration 25" in a["error"] for a in summary["attempts"])


@pytest.mark.long
def test_a_fault_that_keeps_changing_uses_up_the_restarts(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--max-restarts", "1", *SCRIPT_RUN[:1], "2", "--quiet",
               "--restart-backoff", "0", str(HERE / "faulty_train.py"), "--iterations", "30",
               "--fail-at", "5", "--fail-times", "9", "--vary")
    assert r.returncode != 0
    assert "no restart left (1 used)" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["restarts"] == 1
    # before the first checkpoint: both attempts start from the beginning
    assert [a["resumed_from"] for a in summary["attempts"]] == [None, None]
    assert [a["error"].split("data error at iteration 5 ")[1][:12] for a in
            summary["attempts"]] == ["(failure 1)", "(failure 2)"]
    config = json.loads((out / "config.json").read_text())
    assert config["checkpoint_every"] == 100  # implied by --max-restarts


@pytest.mark.long
def test_a_failure_before_registration_reaches_summary_as_its_cause(tmp_path):
    """The server only knows it was stopped; summary.json names the worker and its error."""
    out = tmp_path / "run"
    r = launch(out, *SCRIPT_RUN, "--no-data")
    assert r.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(
        "rank-1 failed before its first iteration")
    assert "FileNotFoundError: no data set at /nowhere/train.bin" in summary["error"]
    assert summary["stopped_by"].startswith("terminated by signal")


def test_max_restarts_is_checked_before_anything_starts(tmp_path):
    r = launch(tmp_path / "run", "--max-restarts", "1", "--baseline", "ddp", *RUN, timeout=60)
    assert r.returncode == 2 and "--baseline runs (torch DDP) keep none" in r.stderr
    r = launch(tmp_path / "run", "--max-restarts", "-1", *RUN, timeout=60)
    assert r.returncode == 2 and "--max-restarts must be >= 0" in r.stderr
