"""Lost workers are detected within --timeout; --elastic goes on without them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import python_module, read_jsonl

TIMEOUT = 6  # seconds: short, yet longer than 3 workers importing torch on 2 busy cores


def start(tmp_path, workers, *server_args, worker_args=("--iterations", "1500")):
    server = subprocess.Popen(python_module("psparse.server", "--workers", str(workers),
                                            "--port", "0", "--out", str(tmp_path), "--timeout",
                                            str(TIMEOUT), *server_args),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (tmp_path / "server.port").is_file():
        assert server.poll() is None, server.communicate()[0]
        time.sleep(0.05)
    port = (tmp_path / "server.port").read_text().strip()
    procs = [subprocess.Popen(python_module("psparse.training.loop", "--rank", str(r), "--workers",
                                            str(workers), "--model", "mlp", "--dataset",
                                            "digits", *worker_args, "--timeout",
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


# a killed worker's connection closes: the server's next send to it fails at once; a frozen one
# keeps its connection and is lost after --timeout of silence
@pytest.mark.parametrize("how, cause", [(signal.SIGKILL, "failed at iteration"),
                                        pytest.param(signal.SIGSTOP,
                                                     "stopped answering at iteration",
                                                     marks=pytest.mark.long)],
                         ids=["kill-9", "frozen"])
def test_lost_worker_ends_the_run_within_the_timeout(tmp_path, how, cause):
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
    assert f"rank 1 {cause}" in server_out
    assert detected < TIMEOUT + 5
    assert [workers[0].returncode, workers[2].returncode] == [1, 1]
    assert all(f"the server ended the run: rank 1 {cause}" in o for o in outs), outs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "rank 1" in summary["error"]


@pytest.mark.long
@pytest.mark.parametrize("values", ["int8"])
def test_elastic_run_continues_without_the_lost_worker(tmp_path, values):
    """With int8 values: the server's rounding memory and the survivors' feedback carry on
    across the loss, and the survivors stay bit-identical (float32 elastic runs: the tests
    below and tests/test_elastic_resume.py)."""
    server, workers = start(tmp_path, 3, "--elastic",
                            worker_args=("--iterations", "1500", "--values", values))
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
    assert summary["values"]["format"] == values and summary["values"]["broadcast_memory"]
    assert all(0 < m["broadcast_value_bytes"] < m["broadcast_bytes"] for m in metrics)


def test_elastic_loss_of_rank_0_moves_evaluation_and_cltk_leaders_to_live_ranks(tmp_path):
    server, workers = start(tmp_path, 3, "--elastic", worker_args=(
        "--iterations", "400", "--policy", "cltk", "--eval-every", "40"))
    try:
        os.kill(workers[0].pid, signal.SIGKILL)
        outs = [w.communicate(timeout=300)[0] for w in workers[1:]]
        server_out = server.communicate(timeout=60)[0]
    finally:
        cleanup(server, *workers)
    assert [w.returncode for w in workers[1:]] == [0, 0], outs
    assert server.returncode == 0, server_out
    summary = json.loads((tmp_path / "summary.json").read_text())
    (lost,) = summary["lost_workers"]
    assert lost["rank"] == 0 and summary["status"] == "ok"
    assert summary["evaluators"] == [{"rank": 0, "from_iter": 0},
                                     {"rank": 1, "from_iter": lost["iter"]}]
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert evals[-1]["iter"] == 399 and summary["test_acc"] == evals[-1]["test_acc"]
    assert [e["iter"] for e in evals if e["iter"] >= lost["iter"]] == \
        [i for i in range(39, 400, 40) if i >= lost["iter"]]
    # the leader of each round is a live rank: every later round keeps k indices (a lost leader
    # would leave every third round with nothing)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    after = [m for m in metrics if m["iter"] > lost["iter"]]
    assert after and all(m["workers"] == 2 and m["union"] == m["budget"] for m in after)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (1, 2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
