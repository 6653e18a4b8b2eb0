"""--elastic with key-range shards (--servers S), on real processes: every shard decides on its
own that a worker is lost, maybe a round apart, and the workers (and the run's merged records)
take a rank any shard lost as lost, so the survivors stay identical and the run equals one
server's. A restart after the loss resumes with the ranks every shard had live."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import read_jsonl, start_launch
from test_restarts import kill_once_saved, launch, restarted_once, without_timing

from psparse import checkpoint
from psparse.launch.processes import writer_of
from psparse.server.membership import Membership
from psparse.server.records import merge_evaluators, merge_losses, merge_records
from psparse.wire import protocol
from psparse.worker.frames import merge_aggregates

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "faulty_train.py")
# rank 2 fails at iteration 25 (a data error: the worker tells every shard as it gives up)
FAILS = ["--workers", "3", "--elastic", "--checkpoint-every", "20", "--quiet", SCRIPT,
         "--iterations", "80", "--fail-at", "25", "--fail-rank", "2"]
# what differs between shard counts: timing, the bytes (a header per shard), the breakdown
NOT_COMPARED = ("upload_bytes", "broadcast_bytes", "shards")


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in NOT_COMPARED}
            for r in without_timing(read_jsonl(out / "metrics.jsonl"))]


def checksums(out: Path, ranks) -> list[str]:
    return [json.loads((out / f"rank-{r}.json").read_text())["checksum"] for r in ranks]


@pytest.mark.long
def test_an_elastic_run_with_shards_equals_one_servers(tmp_path):
    runs = {}
    for shards in (1, 2):
        out = tmp_path / f"s{shards}"
        r = launch(out, "--servers", str(shards), *FAILS)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "rank-2 exited with code 1; --elastic: the run goes on without it" in r.stdout
        runs[shards] = out
    one, two = runs[1], runs[2]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["lost_workers"] == [{"rank": 2, "iter": 25}]
    for i in range(2):  # each shard lost it on its own
        shard = json.loads((two / f"shard-{i}" / "summary.json").read_text())
        assert shard["lost_workers"] == [{"rank": 2, "iter": 25}]
    assert records(two) == records(one)
    assert records(two)[-1]["live"] == [0, 1]
    assert without_timing(read_jsonl(two / "eval.jsonl")) == \
        without_timing(read_jsonl(one / "eval.jsonl"))
    assert checksums(two, (0, 1)) == checksums(one, (0, 1))


@pytest.mark.long
def test_a_silent_worker_is_lost_by_every_shard_and_the_survivors_stay_identical(tmp_path):
    """rank 0 (the evaluator) SIGKILLed mid-run: each shard loses it when its own wait or send
    fails, the workers go on with the ranks every shard still has, rank 1 evaluates."""
    out = tmp_path / "run"
    proc = start_launch("--out", str(out), "--workers", "3", "--servers", "2", "--elastic",
                        "--timeout", "6", "--model", "mlp", "--dataset", "digits",
                        "--iterations", "1500", "--eval-every", "100", "--policy", "cltk",
                        "--quiet")
    metrics = out / "shard-1" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 50):  # training is on
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.kill(writer_of(out / "logs" / "rank-0.log"), signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 1500
    (lost,) = summary["lost_workers"]
    assert lost["rank"] == 0
    for i in range(2):
        shard = json.loads((out / f"shard-{i}" / "summary.json").read_text())
        assert [w["rank"] for w in shard["lost_workers"]] == [0]
        assert shard["lost_workers"][0]["iter"] >= lost["iter"]  # the merge takes the first
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics[0]["workers"] == 3 and "live" not in metrics[0]
    assert metrics[-1]["workers"] == 2 and metrics[-1]["live"] == [1, 2]
    evals = read_jsonl(out / "eval.jsonl")
    assert evals[-1]["iter"] == 1499 and summary["test_acc"] == evals[-1]["test_acc"]
    assert checksums(out, (1, 2))[0] == checksums(out, (1, 2))[1]


@pytest.mark.long
def test_a_sharded_elastic_run_restarts_after_the_loss_with_the_live_ranks(tmp_path):
    """A shard SIGKILLed after the loss: --max-restarts resumes every shard and the two live
    ranks from a checkpoint after it, and the run equals one never interrupted."""
    clean = tmp_path / "clean"
    r = launch(clean, "--servers", "2", *FAILS)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "run"
    proc = start_launch("--out", str(out), "--servers", "2", "--max-restarts", "1",
                        "--restart-backoff", "0.5", *FAILS)
    saved = [out / "shard-0" / "checkpoint" / "server-60.pt",
             out / "shard-1" / "checkpoint" / "server-60.pt",
             out / "checkpoint" / "rank-0-60.pt", out / "checkpoint" / "rank-1-60.pt"]
    kill_once_saved(proc, out, saved, "server-1")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    failed, resumed = restarted_once(out, output)
    assert failed["process"] == "server-1" and resumed["ranks"] == [0, 1]
    assert not (out / "logs" / "rank-2.log").exists()  # the lost rank was not started again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["lost_workers"] == [{"rank": 2, "iter": 25}]
    assert records(out) == records(clean)
    assert checksums(out, (0, 1)) == checksums(clean, (0, 1))


def test_resume_point_takes_the_ranks_every_shard_had_live(tmp_path):
    """Shard 0 got rank 1's push at 40 before it fell silent and still had it live at its
    checkpoint; shard 1 had lost it: the run resumes at 40 without rank 1."""
    for shard, live in ((0, [0, 1, 2]), (1, [0, 2])):
        checkpoint.save(tmp_path / f"shard-{shard}", "server", 40, {"iteration": 40},
                        header={"live": live})
    for r in (0, 2):
        checkpoint.save(tmp_path, f"rank-{r}", 40, {"iteration": 40})
    assert checkpoint.resume_point(tmp_path, 3, shards=2) == (40, [0, 2])


def test_merged_records_and_losses_take_a_rank_any_shard_lost_as_lost():
    base = {"iter": 7, "k": [3, 3], "upload_bytes": 1, "broadcast_bytes": 1, "union": 3,
            "broadcast_entries": 3, "residual_entries": 0, "upload_value_bytes": 0,
            "broadcast_value_bytes": 0, "proposed": None, "dense": False, "round_s": 0.1,
            "time_s": 1.0}
    merged = merge_records([{**base, "workers": 3}, {**base, "workers": 2, "live": [0, 2]}])
    assert merged["live"] == [0, 2] and merged["workers"] == 2
    assert "live" not in merge_records([{**base, "workers": 3}, {**base, "workers": 3}])
    assert merge_losses([[{"rank": 1, "iter": 41}, {"rank": 0, "iter": None}],
                         [{"rank": 1, "iter": 40}]]) == \
        [{"rank": 1, "iter": 40}, {"rank": 0, "iter": None}]



def test_merged_k_is_summed_by_rank_when_the_shards_disagree_on_who_pushed():
    """Shard B had rank 0's push before it fell silent, shard A had lost it: k by rank."""
    base = {"iter": 7, "upload_bytes": 1, "broadcast_bytes": 1, "union": 3,
            "broadcast_entries": 3, "residual_entries": 0, "upload_value_bytes": 0,
            "broadcast_value_bytes": 0, "proposed": None, "dense": False, "round_s": 0.1,
            "time_s": 1.0}
    b = {**base, "workers": 3, "k": [5, 6, 7]}
    a = {**base, "workers": 2, "k": [1, 2], "ranks": [1, 2], "live": [1, 2]}
    merged = merge_records([a, b])  # every rank pushed to some shard: no "ranks"
    assert "ranks" not in merged and merged["k"] == [5, 7, 9]
    assert merged["live"] == [1, 2] and merged["workers"] == 2
    after = merge_records([{**a, "k": [1, 2]}, {**b, "workers": 2, "k": [3, 4], "ranks": [1, 2],
                                                "live": [1, 2]}])
    assert after["ranks"] == [1, 2] and after["k"] == [4, 6]
    assert "ranks" not in merge_records([{**b}, {**b}])


def test_a_worker_takes_as_live_the_ranks_every_shards_aggregate_names():
    def part(lo, live=None):
        header = {"iter": 3, "workers": 3 if live is None else len(live), "count": 1,
                  **({} if live is None else {"live": live})}
        return protocol.Message("aggregate", header, np.array([0], np.int64),
                                np.array([lo], np.float32))
    edges = np.array([0, 10, 20])
    merged = merge_aggregates([part(1.0), part(2.0, [1, 2])], edges)
    assert merged["live"] == [1, 2] and merged["workers"] == 2
    assert list(merged.indices) == [0, 10] and list(merged.values) == [1.0, 2.0]
    merged = merge_aggregates([part(1.0, [0, 2]), part(2.0, [1, 2])], edges)
    assert merged["live"] == [2]
    assert "live" not in merge_aggregates([part(1.0), part(2.0)], edges).header


def test_a_resumed_shard_drops_the_ranks_another_shard_had_lost_and_hands_over_evaluation():
    members = Membership(3, reachable=lambda peer: True, elastic=True)
    members.expect([1, 2])  # the resume point: every shard's live ranks
    members.restore({"active": [0, 1, 2], "lost": [], "evaluators": [{"rank": 0, "from_iter": 0}]},
                    40)
    assert members.active == {1, 2} and members.lost == [{"rank": 0, "iter": 40}]
    assert members.evaluators == [{"rank": 0, "from_iter": 0}, {"rank": 1, "from_iter": 40}]
    agree = Membership(3, reachable=lambda peer: True, elastic=True)
    agree.expect([1, 2])
    agree.restore({"active": [1, 2], "lost": [{"rank": 0, "iter": 39}],
                   "evaluators": [{"rank": 0, "from_iter": 0}, {"rank": 1, "from_iter": 39}]}, 40)
    assert agree.lost == [{"rank": 0, "iter": 39}] and len(agree.evaluators) == 2
    assert merge_evaluators([members.evaluators, agree.evaluators]) == \
        [{"rank": 0, "from_iter": 0}, {"rank": 1, "from_iter": 39}]
