"""Lost workers are detected within --timeout; --elastic goes on without them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import python_module, read_jsonl

TIMEOUT = 3


def start(tmp_path, workers, *server_args):
    server = subprocess.Popen(python_module("psparse.server", "--workers", str(workers),
                                            "--port", "0", "--out", str(tmp_path), "--timeout",
                                            str(TIMEOUT), *server_args),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (tmp_path / "server.port").is_file():
        assert server.poll() is None, server.communicate()[0]
        time.sleep(0.05)
    port = (tmp_path / "server.port").read_text().strip()
    procs = [subprocess.Popen(python_module("psparse.worker", "--rank", str(r), "--workers",
                                            str(workers), "--model", "mlp", "--dataset",
                                            "digits", "--iterations", "1500", "--timeout",
                                            str(TIMEOUT), "--connect", f"127.0.0.1:{port}",
                                            "--out", str(tmp_path)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(workers)]
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 20):
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.05)
    return server, procs


def cleanup(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "frozen"])
def test_lost_worker_ends_the_run_within_the_timeout(tmp_path, how):
    server, workers = start(tmp_path, 3)
    try:
        t0 = time.monotonic()
        os.kill(workers[1].pid, how)
        server_out = server.communicate(timeout=TIMEOUT + 30)[0]
        detected = time.monotonic() - t0
        outs = [w.communicate(timeout=TIMEOUT + 30)[0] for w in (workers[0], workers[2])]
    finally:
        cleanup(server, *workers)
    print(f"lost worker ({signal.Signals(how).name}) detected after {detected:.1f} s "
          f"(timeout {TIMEOUT} s)")
    assert server.returncode == 1
    assert "rank 1 stopped answering at iteration" in server_out
    assert detected < TIMEOUT + 5
    assert [workers[0].returncode, workers[2].returncode] == [1, 1]
    assert all("the server ended the run: rank 1 stopped answering" in o for o in outs), outs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "rank 1" in summary["error"]


def test_elastic_run_continues_without_the_lost_worker(tmp_path):
    server, workers = start(tmp_path, 3, "--elastic")
    try:
        os.kill(workers[2].pid, signal.SIGKILL)
        lost_at = len(read_jsonl(tmp_path / "metrics.jsonl"))
        outs = [w.communicate(timeout=300)[0] for w in workers[:2]]
        server_out = server.communicate(timeout=60)[0]
    finally:
        cleanup(server, *workers)
    assert [w.returncode for w in workers[:2]] == [0, 0], outs
    assert server.returncode == 0 and "elastic: lost rank 2" in server_out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 1500
    assert [w["rank"] for w in summary["lost_workers"]] == [2]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[0]["workers"] == 3 and metrics[-1]["workers"] == 2
    assert lost_at <= summary["lost_workers"][0]["iter"] + 1
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # survivors still identical
