"""Checkpoint/resume: a run stopped mid-way and resumed ends exactly as an uninterrupted one."""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import read_jsonl, run_launch, start_launch

RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "400",
       "--eval-every", "50", "--checkpoint-every", "100", "--seed", "4", "--quiet"]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


@pytest.mark.parametrize("extra", [
    [],  # the other three cover a policy's state, a server limit, the recall probe and values
    pytest.param(["--policy", "core", "--server-limit", "1.5k"], marks=pytest.mark.long),
    pytest.param(["--policy", "exdyna", "--density", "0.05", "--probe-recall", "25"], marks=pytest.mark.long),
    pytest.param(["--values", "int4", "--server-limit", "1.5k"], marks=pytest.mark.long)],
                         ids=["topk", "core+limit", "exdyna+probe", "int4+limit"])
def test_resumed_run_equals_an_uninterrupted_one(tmp_path, extra):
    whole = run_launch("--out", str(tmp_path / "whole"),
                       *RUN, *extra, timeout=300)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    cut = tmp_path / "cut"
    proc = start_launch("--out", str(cut), *RUN, *extra)
    deadline = time.monotonic() + 120
    while not ((cut / "checkpoint" / "server-200.pt").is_file()
               and len(read_jsonl(cut / "metrics.jsonl")) >= 230):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # stop everything mid-run
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    stopped_at = len(read_jsonl(cut / "metrics.jsonl"))
    assert stopped_at < 400
    # The stop lands at iteration 230 or later, but on a loaded machine the run can reach the
    # next checkpoint before every process has exited: the resume must take the newest one that
    # the server and all three workers saved.
    saved = [{int(p.stem.split("-")[-1]) for p in (cut / "checkpoint").glob(f"{who}-*.pt")}
             for who in ("server", "rank-0", "rank-1", "rank-2")]
    latest = max(set.intersection(*saved))
    assert 200 <= latest < 400

    resumed = run_launch("--resume", str(cut), "--quiet", timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed at iteration {latest}" in (cut / "logs" / "server.log").read_text()
    names = ["metrics.jsonl", "eval.jsonl"] + (["recall.jsonl"] if "--probe-recall" in extra
                                                else [])
    for name in names:
        assert without_timing(read_jsonl(cut / name)) == \
            without_timing(read_jsonl(tmp_path / "whole" / name)), name
    for r in range(3):
        a = json.loads((cut / f"rank-{r}.json").read_text())
        b = json.loads((tmp_path / "whole" / f"rank-{r}.json").read_text())
        assert a["checksum"] == b["checksum"]  # bit-identical final weights
        assert a["push_bytes"] == b["push_bytes"]
    sa = json.loads((cut / "summary.json").read_text())
    sb = json.loads((tmp_path / "whole" / "summary.json").read_text())
    for key in ("union_over_k_mean", "upload_mb", "broadcast_mb", "test_acc", "server_limit",
                "values"):  # (values: the server's rounding memory, held_l1 included)
        assert sa.get(key) == sb.get(key), key


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    r = run_launch("--resume", str(tmp_path / "run"), timeout=60)
    assert r.returncode == 2 and "no config.json" in r.stderr
