"""--tensorboard on real runs, read back with the tensorboard package's own event loader: one
TensorBoard run per psparse run, each per-iteration scalar equal to metrics.jsonl's, the
evaluations, rank 0's time split, and a restarted run's events without the failed attempt's
doubles."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import read_jsonl, run_launch

HERE = Path(__file__).resolve().parent
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard package is not installed (make install installs it: .[dev])")


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def launch(out: Path, *args: str) -> subprocess.CompletedProcess:
    r = run_launch("--quiet", "--out", str(out), *args, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_a_run_on_the_board_is_its_records(tmp_path):
    board = tmp_path / "tb"
    launch(tmp_path / "lenet-run", "--workers", "2", "--model", "mlp", "--dataset", "digits",
           "--iterations", "30", "--eval-every", "10", "--tensorboard", str(board))
    assert [p.name for p in board.iterdir()] == ["lenet-run"]  # one TensorBoard run
    got = scalars(board / "lenet-run")
    rows = read_jsonl(tmp_path / "lenet-run" / "metrics.jsonl")
    steps = [r["iter"] for r in rows]
    close = pytest.approx  # (TensorBoard stores float32)
    assert got["train/loss"] == [(r["iter"], close(r["loss"], rel=1e-6)) for r in rows]
    assert got["send_kb/pushed"] == [(r["iter"], close(r["upload_bytes"] / 1e3)) for r in rows]
    assert got["send_kb/broadcast"] == [(r["iter"], close(r["broadcast_bytes"] / 1e3))
                                        for r in rows]
    assert got["round/union_over_k"] == [(r["iter"], close(r["union"] / r["budget"], rel=1e-6))
                                         for r in rows]
    assert got["round/overflow"] == [(s, 0.0) for s in steps]
    evals = read_jsonl(tmp_path / "lenet-run" / "eval.jsonl")
    assert got["eval/test_acc"] == [(e["iter"], close(e["test_acc"], rel=1e-6)) for e in evals]
    for name in ("compute", "select", "wait"):  # rank 0's own, every iteration
        assert [s for s, _ in got[f"time_ms/{name}"]] == steps
        assert all(v >= 0 for _, v in got[f"time_ms/{name}"])
    assert sum(v for _, v in got["time_ms/wait"]) > 0


@pytest.mark.long
def test_a_restarted_run_has_each_iteration_once_and_its_restart(tmp_path):
    """Rank 1 fails at iteration 25 once; the run restarts from its checkpoint at 20: the
    board holds iterations 0..59 once each (the failed attempt's 20..24 purged) and
    run/restarts = 1 at iteration 20."""
    board = tmp_path / "tb"
    launch(tmp_path / "run", "--workers", "2", "--checkpoint-every", "20", "--max-restarts", "1",
           "--restart-backoff", "0", "--tensorboard", str(board),
           str(HERE / "faulty_train.py"), "--iterations", "60", "--fail-at", "25")
    got = scalars(board / "run")
    assert [s for s, _ in got["train/loss"]] == list(range(60))
    assert got["run/restarts"] == [(20, 1.0)]
    assert [s for s, _ in got["time_ms/select"]] == list(range(60))


def test_the_flag_without_the_package_is_refused_before_anything_starts(tmp_path):
    r = run_launch("--out", str(tmp_path / "x"), "--workers",
                   "2", "--model", "mlp", "--dataset", "digits",
                   "--tensorboard", str(tmp_path / "tb"),
                   timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE / "no_tensorboard")})
    assert r.returncode == 2 and "--tensorboard needs the tensorboard package" in r.stderr
    assert not (tmp_path / "x").exists()
