"""The device check fails when a speed target is missed (benchmarks/gpu_check.py, TARGETS).

Shown without a GPU: the selection benchmark runs on the CPU (benchmarks/gpu_select.py, the
same script the check runs on the device), and ``gpu_check.py --judge`` judges its figures
against the bars, one of them raised past anything a machine can do. A missed target and a
target not measured both fail the check, naming the target; a met one is reported met.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("select")
    r = subprocess.run([sys.executable, "benchmarks/gpu_select.py", "--device", "cpu", "--sizes",
                        "1e6", "--repeats", "3", "--json", str(out / "select.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    path = out / "gpu_check.json"
    path.write_text(json.dumps({"selection": json.loads((out / "select.json").read_text())}))
    return path


def judge(path, *bars):
    args = [a for bar in bars for a in ("--bar", bar)]
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--judge", str(path),
                           *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_raised_bar_fails_the_check_naming_the_target(figures):
    r = judge(figures, "selection-1m=1e9")
    assert r.returncode == 1
    assert "target selection-1m (radix selection at 1M / 1%, eager, vs torch.topk)" in r.stdout
    assert "needs >= 1e+09" in r.stdout


def test_a_met_target_is_met_and_one_not_measured_still_fails(figures):
    r = judge(figures, "selection-1m=0", "policies=1e9")
    assert r.returncode == 1  # 25M, the exchange and LeNet were not measured here
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line[:1] != "t"}
    assert lines["selection-1m"].endswith(": met") and lines["policies"].endswith(": met")
    assert "target exchange" in r.stdout and "not measured" in r.stdout


def test_an_unknown_target_is_refused(figures):
    r = judge(figures, "speed=3")
    assert r.returncode != 0 and "unknown target 'speed'" in r.stderr


def test_the_benchmark_times_each_launch_of_a_selection(figures):
    """Per-kernel times (on a GPU at 25M / 0.1%; here the emulator's launch sequence): a
    32-bit top-k is five launches, two of them over every entry."""
    launches = json.loads(figures.read_text())["selection"]["launches"]
    assert launches["launches"] == 5 and launches["backend"] == "emulated"
    assert [r["kernel"] for r in launches["kernels"]] == [
        "psparse_rs_hist0", "psparse_rs_write_cand", "psparse_rs_hist", "psparse_rs_hist",
        "psparse_rs_final_i64"]
    assert all(r["ms"] > 0 for r in launches["kernels"])
    assert abs(sum(r["share"] for r in launches["kernels"]) - 1) < 0.01
