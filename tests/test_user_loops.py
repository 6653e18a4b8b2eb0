"""The loops people write, on real processes: open-ended runs a rank stops (with epochs of
different lengths, checkpoints and --resume), gradient accumulation with and without overlap,
and the misuses that must fail naming their fix (tests/user_loops.py is the script)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_jsonl
from test_api import HERE, launch, without_timing

import psparse
from psparse.config import ConfigError
from psparse.worker.client import ServerGone, WorkerError

SCRIPT = str(HERE / "user_loops.py")


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def params(out: Path, rank: int) -> np.ndarray:
    return np.load(out / f"params-{rank}.npy")


@pytest.mark.long
def test_an_open_ended_run_stopped_by_a_rank_ends_ok_and_resumes_exactly(tmp_path):
    """No iterations at connect; rank 1 asks to stop at iteration 57 and every rank leaves
    after that round, though their epochs differ in length (rank 1's are one batch longer);
    a run that fails at iteration 45 and is resumed from its checkpoint of 40 ends the same,
    bit for bit."""
    run = ["--workers", "2", "--density", "0.05", "--checkpoint-every", "20", SCRIPT,
           "--stop-at", "57", "--stop-rank", "1", "--ragged"]
    whole = launch(tmp_path / "whole", *run)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    s = summary(tmp_path / "whole")
    assert (s["status"], s["ended"], s["iterations"]) == \
        ("ok", "stopped by rank 1 at iteration 57", 58)
    loops = [(tmp_path / "whole" / f"loop-{r}.txt").read_text() for r in range(2)]
    assert loops == ["iteration 58 evaluations [44, 58]\n",
                     "iteration 58 evaluations [45, 58]\n"]  # its own epochs, one exit
    assert np.array_equal(params(tmp_path / "whole", 0), params(tmp_path / "whole", 1))
    cut = tmp_path / "cut"
    failed = launch(cut, *run, "--fail-at", "45")
    assert failed.returncode != 0 and "planted failure at iteration 45" in summary(cut)["error"]
    resumed = launch(cut, "--resume", str(cut))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert summary(cut)["ended"] == "stopped by rank 1 at iteration 57"
    assert without_timing(read_jsonl(cut / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    for rank in range(2):
        assert np.array_equal(params(cut, rank), params(tmp_path / "whole", rank))


@pytest.mark.long
def test_gradient_accumulation_exchanges_once_per_step_with_and_without_overlap(tmp_path):
    """Two micro-batches per exchange, the first in ps.accumulating(): one round per step;
    with overlap the hooks push only on the last micro-batch's backward (a push on the first
    would be refused when the second backward completes the bucket again), and the weights
    are bit-identical to the run that exchanges the same buckets after backward. Both runs
    are open-ended: the stop travels in a run with parts too."""
    weights = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap-{overlap}"
        r = launch(out, "--workers", "2", "--density", "0.05", "--granularity", "layer",
                   "--bucket-mb", "0.004", *(["--overlap"] if overlap else []), SCRIPT,
                   "--stop-at", "29", "--accumulate", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(read_jsonl(out / "metrics.jsonl")) == 30  # one round per step
        assert summary(out)["ended"] == "stopped by rank 0 at iteration 29"
        # mid-curve after 30 steps: 54.6% under every kernel set tried; chance is 10%
        assert summary(out)["test_acc"] > 0.3
        report = json.loads((out / "rank-0.json").read_text())["overlap"]
        buckets = len(report["parts"]) - 1
        assert buckets >= 3
        if overlap:  # at most one round's worth per step: the last micro-batch's backward
            assert 30 <= report["pushes_in_backward"] <= 30 * (buckets - 1)
        else:
            assert report["pushes_in_backward"] == 0
        weights[overlap] = params(out, 0)
    assert np.array_equal(weights[False], weights[True])


def test_a_script_that_ends_without_close_is_told_to_close_or_use_with(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "2", SCRIPT, "--iterations", "10", "--misuse", "no-close",
               timeout=120)
    assert r.returncode != 0
    s = summary(out)
    assert (s["status"], s["ended"]) == ("failed", "failed")
    assert ("failed after the last iteration: the script ended without ps.close() after the "
            "run's last iteration: end training with ps.close(...)") in s["error"], s["error"]
    assert "`with psparse.connect(...) as ps:`" in s["error"]


def test_a_script_run_by_python_that_ends_without_close_is_told_too(server_factory):
    """Without the launcher (python train.py, as torchrun runs it) an atexit hook reports it."""
    server = server_factory(1)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "PSPARSE_OUT": str(server.out),
           "PSPARSE_SERVER": f"127.0.0.1:{server.port}"}
    r = subprocess.run([sys.executable, SCRIPT, "--iterations", "3", "--misuse", "no-close"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=HERE)
    assert "psparse: error: the script ended without ps.close()" in r.stderr, r.stderr
    assert server.wait()[0] == 1
    assert "the script ended without ps.close()" in summary(server.out)["error"]


def one_worker(server, model, **kw):
    return psparse.connect(model, torch.optim.SGD(model.parameters(), lr=0.1), rank=0,
                           world_size=1, server=f"127.0.0.1:{server.port}", **kw)


@pytest.mark.parametrize("zero_grad", [False, True], ids=["aggregate-in-grad", "grad-none"])
def test_an_exchange_without_a_backward_since_the_last_is_refused(server_factory, zero_grad):
    server = server_factory(1)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(WorkerError, match="without a backward pass since the last exchange"):
        with one_worker(server, model, iterations=5) as ps:
            loss = model(torch.ones(4, 3)).sum()
            loss.backward()
            ps.exchange(loss)
            ps.optimizer.step()
            if zero_grad:
                ps.optimizer.zero_grad()
            ps.exchange(loss)  # no backward: the aggregate (or nothing) would be sent again
    assert server.wait()[0] == 1
    assert summary(server.out)["error"].startswith(
        "rank 0 failed at iteration 1: exchange() at iteration 1 without a backward pass")


def test_a_failure_before_registration_reaches_the_summary(server_factory):
    server = server_factory(1)
    with pytest.raises(ConfigError, match="float32"):
        one_worker(server, torch.nn.Linear(3, 2).half(), iterations=5)
    assert server.wait()[0] == 1
    assert summary(server.out)["error"] == (
        "rank 0 failed before training started: psparse exchanges float32 parameters; "
        "convert the model with .float() (not float32: weight (torch.float16), bias "
        "(torch.float16))")


def test_a_refused_register_ends_the_worker_at_once_with_the_servers_reason(server_factory):
    server = server_factory(2, extra=("--run-token", "secret"))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="world_size 3 does not match the server's 2"):
        psparse.connect(torch.nn.Linear(3, 2), rank=0, world_size=3, iterations=5,
                        server=f"127.0.0.1:{server.port}", run_token="secret", timeout=20)
    assert time.monotonic() - t0 < 10  # not the 20 s timeout
    code, log = server.wait(timeout=20)
    assert code == 1
    s = summary(server.out)
    assert s["error"] == ("rank 0 failed before training started: the server rejected our "
                          "message: world_size 3 does not match the server's 2"), log


def test_without_a_server_the_error_names_the_address_and_how_to_set_it():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerGone) as err:
        psparse.connect(torch.nn.Linear(3, 2), rank=0, world_size=1, iterations=5,
                        server=f"127.0.0.1:{port}", timeout=1)
    assert f"no answer from a psparse server at 127.0.0.1:{port} within 1 s" in str(err.value)
    assert "PSPARSE_SERVER=host:port" in str(err.value)


class Bag(torch.nn.Module):
    """An embedding (sparse gradients or dense) and a head: a language model's first layer."""

    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def train_bag(server, sparse: bool) -> torch.Tensor:
    """Five Adam steps of ``Bag`` through psparse, tokens repeated within each batch."""
    model = Bag(sparse)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    with psparse.connect(model, optimizer, rank=0, world_size=1, iterations=5, density=1.0,
                         server=f"127.0.0.1:{server.port}") as ps:
        for _ in range(ps.start, ps.iterations):
            tokens = torch.randint(0, 10, (4, 6), generator=generator)  # repeats: summed
            loss = torch.nn.functional.cross_entropy(model(tokens), torch.tensor([0, 1, 2, 0]))
            loss.backward()
            ps.exchange(loss)
            optimizer.step()
            optimizer.zero_grad()  # set to None: the next backward makes a new sparse tensor
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_sparse_embedding_trains_as_a_dense_one_and_sparse_adam_is_refused(server_factory):
    dense = train_bag(server_factory(1), sparse=False)
    sparse = train_bag(server_factory(1), sparse=True)
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-7)  # the sums' order may differ
    assert not torch.equal(dense, torch.cat([p.detach().flatten()
                                             for p in Bag(False).parameters()]))  # it trained
    model = Bag(sparse=True)
    with pytest.raises(ConfigError, match="SparseAdam takes sparse gradients only.*use "
                                          "torch.optim.Adam or AdamW"):
        psparse.connect(model, torch.optim.SparseAdam(list(model.embed.parameters())),
                        rank=0, world_size=1, iterations=5, server="127.0.0.1:1")
