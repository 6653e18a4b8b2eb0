"""A non-finite loss or accumulator: an overflow to skip under a GradScaler, else the worker
stops with one error that says what diverged and what to change (psparse.worker.divergence),
whichever round (host, device, in parts) or loop met it. End to end: a real run whose
learning rate makes it diverge fails with that error in its summary."""

import json
import subprocess
import sys

import pytest
import torch

from psparse.worker.client import WorkerError
from psparse.worker.divergence import accumulator_diverged, read_loss, require_scaler


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), torch.tensor(float("-inf"))])
def test_a_non_finite_loss_without_a_scaler_is_a_divergence(loss):
    with pytest.raises(WorkerError, match=r"training diverged at iteration 7: loss is .*"
                                          r"lower the learning rate"):
        read_loss(loss, 7, None)


def test_a_non_finite_loss_under_a_scaler_is_an_overflow():
    assert read_loss(torch.tensor(float("nan")), 3, scaling=object()) == (None, True)
    assert read_loss(torch.tensor(2.5), 3, scaling=object()) == (2.5, False)
    assert read_loss(None, 3, None) == (None, False)
    value, overflow = read_loss(torch.tensor(1.25, dtype=torch.bfloat16), 3, None)
    assert value == 1.25 and not overflow and isinstance(value, float)


def test_the_accumulator_error_names_the_iteration_and_the_scaler_remedy():
    exc = accumulator_diverged(12, "the accumulator holds 3 NaN or inf entries")
    assert str(exc).startswith("training diverged at iteration 12: the accumulator holds 3")
    assert "GradScaler" in str(exc) and "connect(..., scaler=scaler)" in str(exc)


def test_a_flagged_round_needs_a_scaler():
    class Ctx:
        scaling = None
    with pytest.raises(WorkerError, match="flagged iteration 4 as an overflow"):
        require_scaler(Ctx(), 4)


def test_a_run_that_diverges_says_so_in_its_summary(tmp_path, data_root):
    """LeNet at lr 1e6 diverges within a few iterations; the worker's error reaches
    summary.json and the launcher exits non-zero."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "psparse.launch", "--workers", "2", "--model", "lenet",
         "--dataset", "mnist", "--data-dir", str(data_root), "--iterations", "30",
         "--eval-every", "0", "--lr", "1e6", "--density", "0.01", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "training diverged at iteration" in summary["error"], summary["error"]
