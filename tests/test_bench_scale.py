"""benchmarks/bench_scale.py (make bench-scale) at its smallest configuration: real launches at
N = 2 workers and S = 1, 2 server shards, a few iterations, and the invariants its tables rest
on (no wall-clock assertions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_scale  # noqa: E402


@pytest.mark.long
def test_smallest_grid_shard_bytes_and_tables(tmp_path, monkeypatch, data_root):
    monkeypatch.setenv("PSPARSE_DATA", str(data_root))
    results = tmp_path / "scale.json"
    figure = tmp_path / "scale.png"
    rc = bench_scale.main(["--part", "grid", "--sizes", "lenet", "--policies", "topk",
                           "--workers", "2", "--servers", "1,2", "--iterations", "4",
                           "--runs", str(tmp_path / "runs"), "--results", str(results),
                           "--figure", str(figure)])
    assert rc == 0
    rows = {r["servers"]: r for r in json.loads(results.read_text())["grid"]}
    assert set(rows) == {1, 2} and not any("failed" in r for r in rows.values())
    for s, r in rows.items():
        assert len(r["shard_link_b"]) == s and r["iterations"] == 4
        # measure() raises if any iteration's shard bytes miss the totals; check it here too
        assert np.isclose(sum(r["shard_link_b"]), r["total_b"])
        assert np.isclose(r["total_b"], r["upload_b"] + r["broadcast_b"])
        assert r["server_max_b"] == max(r["shard_link_b"])
    run2 = tmp_path / "runs" / rows[2]["run"]
    for line in (run2 / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert sum(s["upload_bytes"] for s in m["shards"]) == m["upload_bytes"]
        assert sum(s["broadcast_bytes"] for s in m["shards"]) == m["broadcast_bytes"]
    # the same selections at S = 1 and 2; each shard's link carries less than the one server's
    assert rows[1]["union_k"] == rows[2]["union_k"]
    assert rows[2]["server_max_b"] < rows[1]["server_max_b"]
    assert rows[2]["server_mean_b"] < 0.6 * rows[1]["server_mean_b"]
    table = bench_scale.grid_table(list(rows.values()))
    assert "busiest server link KB/iter" in table and table.count("| lenet | topk | 2 |") == 2
    assert figure.exists()
    # a second call reuses the finished runs (same arguments) and gives the same bytes
    bench_scale.main(["--part", "grid", "--sizes", "lenet", "--policies", "topk",
                      "--workers", "2", "--servers", "2", "--iterations", "4",
                      "--runs", str(tmp_path / "runs"), "--results", str(results),
                      "--figure", str(figure)])
    again = [r for r in json.loads(results.read_text())["grid"] if r["servers"] == 2]
    assert len(again) == 1 and again[0]["shard_link_b"] == rows[2]["shard_link_b"]


def test_aggregation_rows_are_consistent():
    rows = bench_scale.aggregation_part([("tiny", 10_000, 0.01)], (2, 4), repeats=3)
    assert [r["workers"] for r in rows] == [2, 4]
    for r in rows:
        assert r["bytes"] == r["workers"] * r["k"] * 8
        assert r["k"] <= r["union"] <= r["workers"] * r["k"]
        assert r["ratio"] > 0
    assert "aggregate / memcpy throughput" in bench_scale.aggregation_table(rows)
