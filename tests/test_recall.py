"""The recall probe (--probe-recall): how much of the global top-k a round's aggregate holds,
measured on real runs (real processes sharing a run directory)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import python_module, read_jsonl, run_launch

from psparse.worker.recall import measures, truncate

RUN = ["--model", "mlp", "--dataset", "digits", "--iterations", "60", "--eval-every", "0",
       "--density", "0.05", "--seed", "3", "--quiet", "--probe-recall", "20"]


def launch(out, *args):
    r = run_launch("--out", str(out), *RUN, *args, timeout=300)
    return r


def test_measures_by_hand():
    total = np.array([3.0, -1.0, 0.5, -2.0])  # |S| order: 0, 3, 1, 2
    norm = 9 + 1 + 0.25 + 4
    m = measures(total, np.array([0, 2]), k=2)
    assert m == {"recall": 0.5, "energy": (9 + 0.25) / norm, "energy_topk": (9 + 4) / norm}
    # ties go to the lower index, as the host selection's
    assert measures(np.array([1.0, 1.0, 1.0]), np.array([0]), k=1)["recall"] == 1.0
    assert measures(np.array([1.0, 1.0, 1.0]), np.array([2]), k=1)["recall"] == 0.0


def test_rows_of_a_real_run(tmp_path):
    r = launch(tmp_path / "run", "--workers", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_jsonl(tmp_path / "run" / "recall.jsonl")
    assert [row["iter"] for row in rows] == [0, 20, 40]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for row in rows:
        assert row["workers"] == 3 and row["k"] == metrics[row["iter"]]["budget"]
        assert row["union"] == metrics[row["iter"]]["broadcast_entries"]
        assert 0 < row["recall"] <= 1 and 0 < row["energy_topk"] <= 1
    assert not list((tmp_path / "run" / "probes").iterdir())  # summed, then deleted
    report = subprocess.run(python_module("psparse.analysis.report", str(tmp_path / "run"), "--out",
                                          str(tmp_path / "rep")),
                            capture_output=True, text=True, timeout=120)
    mean = np.mean([row["recall"] for row in rows])
    assert report.returncode == 0 and f"{mean:.3f}" in report.stdout, report.stdout


def test_one_worker_sends_the_global_top_k(tmp_path):
    """Alone, a worker's accumulator is the sum: top-k selects exactly the global top-k."""
    r = launch(tmp_path / "run", "--workers", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_jsonl(tmp_path / "run" / "recall.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["recall"] == 1.0 and row["energy"] == pytest.approx(row["energy_topk"])


def test_aligned_rounds_recall_more_than_unaligned(tmp_path):
    """randomk ignores magnitude: its aggregate holds far less of the global top-k than
    top-k's (a probe that measured nothing would give the two alike)."""
    got = {}
    for policy in ("topk", "randomk"):
        r = launch(tmp_path / policy, "--workers", "3", "--policy", policy)
        assert r.returncode == 0, r.stdout + r.stderr
        got[policy] = np.mean([row["recall"] for row in
                               read_jsonl(tmp_path / policy / "recall.jsonl")])
    assert got["topk"] > 2 * got["randomk"], got


def test_refused_where_it_cannot_measure(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--granularity", "layer", "--bucket-mb", "1")
    assert r.returncode != 0
    assert "--probe-recall" in r.stdout + r.stderr


def test_truncate_keeps_rows_before_the_resume_point(tmp_path):
    path = tmp_path / "recall.jsonl"
    path.write_text("".join(json.dumps({"iter": i}) + "\n" for i in (0, 25, 50, 75)))
    truncate(path, 50)
    assert [row["iter"] for row in read_jsonl(path)] == [0, 25]
