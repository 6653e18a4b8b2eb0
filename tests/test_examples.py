"""examples/: the custom loop (BatchNorm CNN + Adam on CIFAR-10) and the same with a user policy,
run as users run them, through psparse-launch, for a few iterations."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import data_dir, python_module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("example, policy", [("custom_loop.py", "topk"),
                                             ("custom_policy.py", "recent(bonus=3.0, window=5)")])
def test_example_runs_through_the_launcher(tmp_path, example, policy):
    data = data_dir()
    if not any((data / n).exists() for n in ("cifar10-jpeg.tar.gz", "cifar-10-batches-py")):
        pytest.skip(f"no CIFAR-10 in {data} (make data links it from ../shared/data)")
    out = tmp_path / "run"
    r = subprocess.run(python_module("psparse.launch", "--workers", "2", "--quiet", "--out",
                                     str(out), str(EXAMPLES / example), "--iterations", "6"),
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PSPARSE_DATA": str(data)})
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 6
    assert json.loads((out / "rank-0.json").read_text())["policy"] == policy
