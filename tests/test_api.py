"""The public API (psparse.connect / Session) in users' own scripts, launched like torchrun.

Real processes throughout: psparse-launch starts a real server and runs tests/user_train.py
(its own BatchNorm CNN, Adam, its own Dataset and loop) once per worker.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import python_module, read_jsonl, run_launch, start_launch

import psparse
from psparse.config import ConfigError

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "user_train.py")


def launch(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_launch("--out", str(out), "--quiet", *args, timeout=timeout, cwd=HERE)


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


def test_a_user_script_trains_through_the_launcher(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "4", "--policy", "core", "--density", "0.05", SCRIPT,
               "--iterations", "40")
    assert r.returncode == 0, r.stdout + r.stderr
    params = [np.load(out / f"params-{rank}.npy") for rank in range(4)]
    assert all(np.array_equal(p, params[0]) for p in params)  # replicas agree, bit for bit
    bn = [np.load(out / f"bn-{rank}.npy") for rank in range(4)]
    assert not all(np.array_equal(b, bn[0]) for b in bn)  # BatchNorm buffers are per worker
    assert len(read_jsonl(out / "metrics.jsonl")) == 40
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["iter"] for e in evals] == [9, 19, 29, 39, 39]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["numel"] == 2676
    assert summary["test_acc"] > 0.3  # chance is 0.1 (ten digits)
    # training alone is shorter than the whole run (the final evaluation and reports)
    assert 0 < summary["train_s"] < summary["wall_s"]
    assert summary["train_iterations_per_s"] > summary["iterations_per_s"]
    config = json.loads((out / "config.json").read_text())
    assert config["script"] == f"{SCRIPT} --iterations 40"
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(4)]
    assert len({x["checksum"] for x in ranks}) == 1 and ranks[0]["policy"].startswith("core")
    plots = tmp_path / "plots"
    rep = subprocess.run(python_module("psparse.analysis.report", str(out), "--out", str(plots)),
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert sorted(p.suffix for p in plots.iterdir()) and any(
        p.suffix == ".png" and p.stat().st_size > 1000 for p in plots.iterdir())


def test_ranks_with_different_models_are_refused_naming_the_difference(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "2", SCRIPT, "--mismatch", timeout=120)
    assert r.returncode != 0
    error = json.loads((out / "summary.json").read_text())["error"]
    assert error == ("workers disagree on config.layers[0]: rank 0='conv.weight:8x1x3x3', "
                     "rank 1='conv.weight:12x1x3x3'")


def test_two_phase_policy_and_close_by_hand(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "2", "--policy", "vote", "--density", "0.05", SCRIPT,
               "--iterations", "20", "--no-with")
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 20 and all(m["proposed"] is not None for m in metrics)


@pytest.mark.long
def test_a_user_script_resumes_exactly(tmp_path):
    """--checkpoint-every and --resume for a script: Session.state_dict holds the model (with
    BatchNorm buffers), Adam's state, the accumulator and the policy; the result equals an
    uninterrupted run's."""
    run = ["--workers", "2", "--policy", "core", "--density", "0.05", "--checkpoint-every", "20"]
    whole = launch(tmp_path / "whole", *run, SCRIPT, "--iterations", "130")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    cut = tmp_path / "cut"
    proc = start_launch("--out", str(cut), "--quiet", *run,
                        SCRIPT, "--iterations", "130", cwd=HERE)
    deadline = time.monotonic() + 120
    while not ((cut / "checkpoint" / "server-100.pt").is_file()
               and len(read_jsonl(cut / "metrics.jsonl")) >= 110):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert len(read_jsonl(cut / "metrics.jsonl")) < 130
    resumed = launch(cut, "--resume", str(cut))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(cut / name)) == \
            without_timing(read_jsonl(tmp_path / "whole" / name)), name
    for rank in range(2):
        assert np.array_equal(np.load(cut / f"params-{rank}.npy"),
                              np.load(tmp_path / "whole" / f"params-{rank}.npy"))
        # BatchNorm's running statistics and batch count too: the checkpoint keeps the buffers
        # as they were after the update, not after the next forward pass
        assert np.array_equal(np.load(cut / f"bn-{rank}.npy"),
                              np.load(tmp_path / "whole" / f"bn-{rank}.npy"))


def test_the_built_in_loop_with_a_user_model_and_data_set(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "2", "--model", "user_factories:small_cnn", "--dataset",
               "user_factories:digits_float", "--iterations", "30", "--eval-every", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["numel"] == (6 * 9 + 6) + (6 * 64 * 10 + 10) and summary["test_acc"] > 0.3


@pytest.mark.parametrize("spec, message", [
    ("user_factories:nope", "model factory 'user_factories:nope': no 'nope' in module "
                            "'user_factories'; callables defined there: digits_float, "
                            "not_a_dataset, small_cnn, wide_mlp"),
    ("no_such_module:f", "cannot import the model factory's module 'no_such_module'"),
])
def test_factory_errors_are_refused_before_anything_starts(tmp_path, spec, message):
    r = launch(tmp_path / "run", "--workers", "2", "--model", spec, "--dataset", "digits",
               timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_dataset_factory_returning_something_else_is_named(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--dataset", "user_factories:not_a_dataset",
               "--model", "mlp", "--iterations", "5", timeout=120)
    assert r.returncode != 0
    message = ("dataset factory 'user_factories:not_a_dataset' returned list, expected "
               "psparse.data.Dataset")
    # Both ranks fail alike; whichever fails first is the cause the launcher reports, and the
    # other may be stopped before it writes a word, so neither rank's log is sure to have it.
    assert message in r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and message in summary["error"]
    assert summary["attempts"][-1]["process"] in ("rank-0", "rank-1")


def test_connect_refuses_what_it_cannot_exchange():
    with pytest.raises(ConfigError, match=r"float32 parameters.*0.weight \(torch.float64\)"):
        psparse.connect(torch.nn.Sequential(torch.nn.Linear(3, 2).double()), rank=0,
                        world_size=1, iterations=5)
    with pytest.raises(ConfigError, match="unknown option polcy; valid:"):
        psparse.connect(torch.nn.Linear(3, 2), rank=0, world_size=1, iterations=5, polcy="core")
    with pytest.raises(ConfigError, match="no world size"):
        psparse.connect(torch.nn.Linear(3, 2), rank=0, iterations=3)


def test_a_two_phase_policy_at_density_1_keeps_its_proposal_phase(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--model", "mlp", "--dataset", "digits",
               "--policy", "cltk", "--density", "1", "--iterations", "5", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(m["proposed"] is not None for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


def test_connect_refuses_server_options_and_checkpoints_it_cannot_write(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="checkpoint_every must match the server's"):
        psparse.connect(model, rank=0, world_size=1, iterations=5, checkpoint_every=2)
    (tmp_path / "config.json").write_text('{"workers": 1, "checkpoint_every": 2}')
    monkeypatch.setenv("PSPARSE_CONFIG", str(tmp_path / "config.json"))
    with pytest.raises(ConfigError, match="checkpoints .* need the run directory .* and the "
                                          "optimizer"):
        psparse.connect(model, rank=0, iterations=5, out=tmp_path)
    with pytest.raises(ConfigError, match="must be plain SGD .* got Adam"):
        psparse.connect(model, torch.optim.Adam(model.parameters()), rank=0, iterations=5,
                        memory="dgc", out=tmp_path)


def test_session_state_is_model_sized_and_channels_last_models_work():
    """A checkpoint holds each parameter once (the parameters are views of one flat buffer,
    and a pickled view would write all of it); channels_last parameters are flattened."""
    import pickle

    from psparse.config import RunConfig
    from psparse.worker.session import Session

    layers = [torch.nn.Conv2d(8, 8, 3) for _ in range(10)]
    model = torch.nn.Sequential(*layers).to(memory_format=torch.channels_last)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      RunConfig(workers=1), rank=0, server=("127.0.0.1", 1), iterations=3)
    try:
        numel = sum(p.numel() for p in model.parameters())
        assert session.net.numel == numel
        # the parameters and the accumulator, 4 bytes an entry each, plus a little
        assert len(pickle.dumps(session.state_dict())) < 3 * 4 * numel
        before = [p.detach().clone() for p in model.parameters()]
        session.net.params.add_(1.0)  # the parameters are views of the flat buffer
        assert all(torch.equal(p, b + 1) for p, b in zip(model.parameters(), before))
    finally:
        session.disconnect()


def test_a_missing_script_is_refused_before_anything_starts(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", str(tmp_path / "absent.py"), timeout=60)
    assert r.returncode == 2 and "training script" in r.stderr and "not found" in r.stderr
    assert not (tmp_path / "run").exists()


def test_psparse_imports_without_torch():
    code = "import sys, psparse; print('torch' in sys.modules, psparse.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", psparse.__version__]


def test_a_run_that_logs_only_a_loss_records_and_shows_it(tmp_path):
    """A language model has a loss and no accuracy: ps.log(test_loss=...) alone is an
    evaluation (eval.jsonl, summary.json, the progress line and the summary table)."""
    out = tmp_path / "run"
    r = run_launch("--out", str(out), "--workers", "2",
                   "--density", "0.05", SCRIPT, "--iterations", "20",
                   "--loss-only", timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stdout + r.stderr
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["iter"] for e in evals] == [9, 19, 19]
    assert all("test_acc" not in e and 0 < e["test_loss"] < 10 for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] is None and summary["test_loss"] == evals[-1]["test_loss"]
    shown = f"test loss {evals[-1]['test_loss']:.4f}"
    last_line = [line for line in r.stdout.splitlines() if line.startswith("iter ")][-1]
    assert f"| {shown} |" in last_line, r.stdout  # the progress line's evaluation
    table = [line.split() for line in r.stdout.splitlines() if line.startswith("test ")]
    assert table == [shown.split()], r.stdout  # the summary's row, and no accuracy row
    plots = tmp_path / "plots"  # the report's plots leave out a run with no accuracy
    rep = subprocess.run(python_module("psparse.analysis.report", str(out), "--out", str(plots)),
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert (plots / "union_k.png").is_file() and not (plots / "accuracy_iterations.png").exists()
