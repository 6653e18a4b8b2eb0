"""`make demo` (experiments/demo.py): both runs, one table, the aligning rule's bound held."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, data_dir


def test_the_demo_runs_both_policies_and_prints_one_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "experiments.demo", "--workers", "2", "--epochs",
                        "0.01", "--out", str(tmp_path), "--data-dir", str(data_dir())],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| policy | test accuracy | union/k")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| top-k", "| vote keep=1.5"]
    topk, vote = (json.loads((tmp_path / name / "summary.json").read_text())
                  for name in ("topk", "vote"))
    assert topk["status"] == vote["status"] == "ok" and topk["iterations"] == 10
    # vote keeps round(1.5 k) of the proposals: its union can never exceed that; top-k's, of
    # 2 workers, can reach 2k
    kept = round(1.5 * vote["k"])
    assert vote["union_over_k_max"] <= kept / vote["k"] + 1e-4 < 2.0
    assert topk["union_over_k_max"] <= 2.0
    # the table's bytes column is the summary's, against a ring allreduce of the same model
    moved = vote["upload_mb"] + vote["broadcast_mb"]
    assert f"{100 * moved / vote['allreduce_mb']:.2f}%" in rows[2]
