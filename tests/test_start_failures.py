"""A run that could not start, on real processes: a missing data set, a port in use, a bad
interpreter (--python) and a data set missing on a worker's host each end with the cause on
stderr and in summary.json (status failed), plainly and under --max-restarts, which does not
restart such a run: it would fail the same way (psparse/launch/restart.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import run_launch

from psparse.config import RunConfig

FAKE_RSH = Path(__file__).resolve().parent / "fake_rsh.sh"
RUN = ["--workers", "2", "--model", "mlp", "--iterations", "20", "--quiet"]
RESTARTS = ["--max-restarts", "2", "--restart-backoff", "0"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hostfile_run(tmp_path: Path, port: int) -> list[str]:
    """--hostfile through tests/fake_rsh.sh: the workers' hosts are this one."""
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    return ["--hostfile", str(tmp_path / "hosts"), "--rsh", f"bash {FAKE_RSH}", "--server-host",
            "127.0.0.1", "--bind", "127.0.0.1", "--port", str(port)]


def launch(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "run"
    r = run_launch("--out", str(out), *RUN, *args, timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    return r, json.loads((out / "summary.json").read_text())


def assert_told(r, summary: dict, cause: str, restarts: list[str]) -> None:
    """The cause on stderr and in summary.json; under --max-restarts, one attempt only."""
    assert any(line.startswith("psparse-launch: error: ") and cause in line
               for line in r.stderr.splitlines()), r.stdout + r.stderr
    assert summary["status"] == "failed" and cause in summary["error"], summary
    assert [a["start_failure"] for a in summary["attempts"]] == [True]
    if restarts:
        assert summary["restarts"] == 0
        assert "the run could not start; not restarting it" in r.stdout


@pytest.mark.parametrize("restarts", [[], RESTARTS], ids=["plain", "max-restarts"])
def test_a_missing_data_set_is_named_before_anything_starts(tmp_path, restarts):
    empty = tmp_path / "empty"
    empty.mkdir()
    r, summary = launch(tmp_path, "--dataset", "mnist", "--data-dir", str(empty), *restarts)
    assert_told(r, summary, f"the run could not start: MNIST not found in {empty}/mnist or "
                f"{empty}", restarts)
    assert not (tmp_path / "run" / "logs" / "server.log").exists()  # nothing was started


@pytest.mark.parametrize("restarts", [[], RESTARTS], ids=["plain", "max-restarts"])
def test_a_port_in_use_is_named_before_anything_starts(tmp_path, restarts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, summary = launch(tmp_path, "--dataset", "digits", *hostfile_run(tmp_path, port),
                            *restarts)
    assert_told(r, summary, f"the run could not start: server cannot listen on 127.0.0.1:{port}"
                ": Address already in use (another run or program has that port; choose "
                "another --port)", restarts)


@pytest.mark.parametrize("restarts", [[], RESTARTS], ids=["plain", "max-restarts"])
def test_a_bad_interpreter_on_the_hosts_is_named(tmp_path, restarts):
    r, summary = launch(tmp_path, "--dataset", "digits", *hostfile_run(tmp_path, free_port()),
                        "--python", "/nonexistent/python3", *restarts)
    rank = summary["attempts"][0]["process"]
    assert rank in ("rank-0", "rank-1")
    assert_told(r, summary, f"{rank} could not start: exit code 127, its program was not "
                "found (see --python, --rsh); its last line: env: ", restarts)
    assert "/nonexistent/python3" in summary["error"]  # (quoted as the locale quotes)


def test_a_data_set_missing_on_a_workers_host_is_not_restarted(tmp_path):
    """In a cluster mode the data is on the workers' hosts: a worker tells the server it
    cannot start, and the run is not restarted."""
    empty = tmp_path / "empty"
    empty.mkdir()
    r, summary = launch(tmp_path, "--dataset", "mnist", "--data-dir", str(empty),
                        *hostfile_run(tmp_path, free_port()), *RESTARTS)
    assert_told(r, summary, "failed before training started: DataError: MNIST not found in "
                f"{empty}/mnist", RESTARTS)
    assert os.path.isfile(tmp_path / "run" / "logs" / "server.log")


def test_a_server_that_cannot_resume_is_not_restarted(tmp_path):
    """--resume of a run directory without checkpoints: the server says so and exits before
    it listens."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = RunConfig(workers=2, model="mlp", dataset="digits", iterations=20)
    (out / "config.json").write_text(cfg.to_json())
    r, summary = launch(tmp_path, "--resume", str(out), *RESTARTS)
    assert "server could not start: it exited with code 1 before listening" in r.stderr
    assert_told(r, summary, f"no checkpoint in {out} that the server and every worker live at "
                "it saved", RESTARTS)
