"""What a policy returns is checked on the worker before anything is sent (issue 14, item 5);
a worker's failure reaches summary.json with its rank and cause (item 6)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import python_module, read_jsonl, run_launch

from psparse.policies import Layout, PolicyError, build_policy, check_output

RUN = ["--model", "mlp", "--dataset", "digits", "--iterations", "6", "--eval-every", "0",
       "--quiet"]
K = 24  # round(0.01 x 2410), the mlp's k at the default density

# fault -> what the error must say (besides the class, method and iteration)
FAULTS = {
    "double": "returned 48 indices, more than its budget of 24",
    "float": "returned float64 indices, expected integers",
    "out_of_range": "returned index 2410: out of range [0, 2410)",
    "negative": "returned index -1: indices must be >= 0",
    "unsorted": "returned indices that are not strictly increasing",
}


def launch(out, *args, workers=1):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # finds tests/faulty_policy.py
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    return run_launch("--out", str(out), "--workers",
                      str(workers), *RUN, *args, timeout=300, env=env)


def faulty(fault, at=3, **more):
    args = ["--policy", "faulty_policy:Faulty", "--policy-arg", f"fault={fault}",
            "--policy-arg", f"at={at}"]
    for key, value in more.items():
        args += ["--policy-arg", f"{key}={value}"]
    return args


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_output_names_class_iteration_and_rule(fault):
    policy = build_policy("faulty_policy:Faulty", [f"fault={fault}", "at=5"], Layout([2410]), K)
    acc = np.random.default_rng(0).standard_normal(2410).astype(np.float32)
    check_output(policy, policy.select(acc, 4), 4, policy.max_push)  # before `at`: fine
    with pytest.raises(PolicyError) as err:
        check_output(policy, policy.select(acc, 5), 5, policy.max_push)
    assert f"policy Faulty.select() at iteration 5 {FAULTS[fault]}" in str(err.value)


def test_check_output_refuses_what_is_not_a_1d_array():
    policy = build_policy("topk", None, Layout([10]), 3)
    with pytest.raises(PolicyError, match=r"TopK.propose\(\) at iteration 2 returned list"):
        check_output(policy, [1, 2], 2, 3, "propose")
    with pytest.raises(PolicyError, match=r"shape \(1, 2\), expected a 1-D array"):
        check_output(policy, np.array([[1, 2]]), 2, 3)
    check_output(policy, np.array([], np.int64), 0, 3)  # sending nothing is allowed


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_policy_fault_ends_the_run_with_the_message_in_summary(tmp_path, fault):
    r = launch(tmp_path / "run", *faulty(fault))
    assert r.returncode != 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("rank 0 failed at iteration 3: policy Faulty.select() "
                                       "at iteration 3 "), summary["error"]
    assert FAULTS[fault] in summary["error"]
    # nothing of the bad selection was sent: the server saw 3 good rounds and no bad message
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3
    assert summary["rejected_messages"] == 0


def test_fewer_than_k_is_allowed_counted_and_reported(tmp_path):
    r = launch(tmp_path / "run", *faulty("half", at=0))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["k"] == K and summary["pushed_k_mean"] == K // 2
    assert all(m["k"] == [K // 2] and m["budget"] == K
               for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    report = subprocess.run(python_module("psparse.analysis.report", str(tmp_path / "run"),
                                          "--no-plots", "--out", str(tmp_path / "report")),
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "k sent" in report.stdout
    assert f"{K // 2:>8}" in report.stdout.splitlines()[2]


def test_a_worker_exception_reaches_summary_with_rank_and_cause(tmp_path):
    r = launch(tmp_path / "run", *faulty("raise", at=2, on_rank=1), workers=2)
    assert r.returncode != 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"] == ("rank 1 failed at iteration 2: RuntimeError: this policy broke "
                                "at iteration 2"), summary["error"]


def test_misspelled_policy_class_lists_the_classes_of_the_module(tmp_path):
    r = launch(tmp_path / "run", "--policy", "faulty_policy:Faulti")
    assert r.returncode == 2
    assert ("policy 'faulty_policy:Faulti': no 'Faulti' in module 'faulty_policy'; "
            "SelectionPolicy classes defined there: Faulty, NeedsManyEntries") in r.stderr
    assert not (tmp_path / "run").exists()


def test_pre_start_check_builds_the_policy_on_the_real_layout_and_k(tmp_path):
    r = launch(tmp_path / "run", "--policy", "faulty_policy:NeedsManyEntries")
    assert r.returncode == 0, r.stdout + r.stderr
    # and a policy that is invalid on the real model is still refused before anything starts
    r = launch(tmp_path / "run2", "--policy", "faulty_policy:NeedsManyEntries", "--density",
               "0.0001")
    assert r.returncode == 2 and "numel 2410 and k 1 are too small" in r.stderr
    assert not (tmp_path / "run2").exists()
