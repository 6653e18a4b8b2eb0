"""End-to-end runs with real processes: launcher, standalone server/worker CLIs, real data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from conftest import alive, descendants, python_module, read_jsonl, run_launch, start_launch

from psparse.training.models import LeNet5

TIMING_FIELDS = ("round_s", "time_s")


def launch(out, *args, timeout=300, data_root=None):
    env = {**os.environ}
    if data_root is not None:
        env["PSPARSE_DATA"] = str(data_root)
    return run_launch("--out", str(out), *args, timeout=timeout, env=env)


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


@pytest.mark.long
def test_replicas_stay_bit_identical_across_standalone_processes(tmp_path, data_root):
    """psparse-server + 4 psparse-worker processes, LeNet on MNIST, 50 iterations."""
    n = 4
    server = subprocess.Popen(python_module("psparse.server", "--workers", str(n), "--port", "0",
                                            "--out", str(tmp_path), "--timeout", "60"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not (tmp_path / "server.port").is_file():
            assert server.poll() is None, server.communicate()[0]
            time.sleep(0.05)
        port = (tmp_path / "server.port").read_text().strip()
        common = ["--workers", str(n), "--model", "lenet", "--dataset", "mnist", "--data-dir",
                  str(data_root), "--iterations", "50", "--check-every", "1", "--eval-every",
                  "25", "--threads", "1", "--connect", f"127.0.0.1:{port}", "--out",
                  str(tmp_path)]
        workers = [subprocess.Popen(python_module("psparse.training.loop", "--rank", str(r),
                                                  "--save-weights", str(tmp_path / f"w{r}.pt"),
                                                  *common),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for r in range(n)]
        outputs = [w.communicate(timeout=240)[0] for w in workers]
        assert [w.returncode for w in workers] == [0] * n, outputs
        assert server.wait(timeout=30) == 0
    finally:
        for p in [server, *locals().get("workers", [])]:
            if p.poll() is None:
                p.kill()
    states = [torch.load(tmp_path / f"w{r}.pt") for r in range(n)]
    for state in states[1:]:
        for name, tensor in states[0].items():
            assert torch.equal(tensor, state[name]), name  # bit-identical, not just close
    torch.manual_seed(0)  # the workers' seed: the same initial weights
    initial = LeNet5().state_dict()
    assert not torch.equal(initial["fc1.weight"], states[0]["fc1.weight"])  # training happened
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 50 and all(m["k"] == [617] * n for m in metrics)
    assert all(617 <= m["union"] <= n * 617 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(n)]
    assert len({r["checksum"] for r in ranks}) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["k"] == 617
    assert [e["iter"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [24, 49]
    # the server's per-round byte counts add up to what the workers say they sent and received
    assert sum(m["upload_bytes"] for m in metrics) == sum(r["push_bytes"] for r in ranks)
    assert sum(m["broadcast_bytes"] for m in metrics) == sum(r["aggregate_bytes"] for r in ranks)


def test_same_seed_same_metrics_and_run_dir_contents(tmp_path):
    args = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "40",
            "--eval-every", "10", "--seed", "5"]
    a, b = launch(tmp_path / "a", *args), launch(tmp_path / "b", *args)
    assert a.returncode == 0, a.stdout + a.stderr
    assert b.returncode == 0, b.stdout + b.stderr
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(tmp_path / "a" / name)) == \
            without_timing(read_jsonl(tmp_path / "b" / name))
    c = launch(tmp_path / "c", *args[:-1], "6")
    assert c.returncode == 0
    assert without_timing(read_jsonl(tmp_path / "a" / "metrics.jsonl")) != \
        without_timing(read_jsonl(tmp_path / "c" / "metrics.jsonl"))

    run = tmp_path / "a"
    for f in ("config.json", "metrics.jsonl", "eval.jsonl", "summary.json", "logs/server.log",
              "logs/rank-0.log", "logs/rank-2.log"):
        assert (run / f).is_file(), f
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["workers"] == 3 and cfg["seed"] == 5 and cfg["model"] == "mlp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 40 and summary["test_acc"] > 0.5
    # the summary table and progress lines
    assert "test accuracy" in a.stdout and "union/k" in a.stdout
    assert "dense ring allreduce" in a.stdout
    assert "iter     40" in a.stdout


def test_config_file_and_flags(tmp_path):
    (tmp_path / "run.toml").write_text('model = "mlp"\ndataset = "digits"\nworkers = 2\n'
                                       'iterations = 5\nbatch-size = 8\n')
    r = launch(tmp_path / "r", "--config", str(tmp_path / "run.toml"), "--batch-size", "4")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["batch_size"] == 4 and cfg["workers"] == 2  # the flag wins over the file

    (tmp_path / "bad.json").write_text('{"model": "mlp", "learning_rate": 0.1}')
    r = launch(tmp_path / "x", "--config", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "unknown option 'learning_rate'" in r.stderr
    assert "batch-size" in r.stderr  # lists the valid ones
    r = launch(tmp_path / "x", "--model", "vgg")
    assert r.returncode == 2 and "model 'vgg' unknown; choose one of" in r.stderr
    r = launch(tmp_path / "x", "--density", "0")
    assert r.returncode == 2 and "density must be in (0, 1]" in r.stderr
    (tmp_path / "broken.json").write_text("{not json")
    r = launch(tmp_path / "x", "--config", str(tmp_path / "broken.json"))
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def _wait_for_metrics(path, lines=3, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.1)
    raise AssertionError(f"no training progress in {path}")


def test_killed_worker_fails_the_run_and_leaves_no_process(tmp_path):
    out = tmp_path / "run"
    proc = start_launch("--out", str(out), "--workers", "3",
                        "--model", "mlp", "--dataset", "digits",
                        "--iterations", "1000000", "--timeout", "10")
    try:
        _wait_for_metrics(out / "metrics.jsonl")
        children = descendants(proc.pid)
        assert len(children) == 4  # server + 3 workers
        victim = children[-1]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        output = proc.communicate(timeout=30)[0]
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "exited with code -9" in output
    assert elapsed < 10 + 5
    time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)], "processes left behind"


@pytest.mark.long
def test_workers_exit_nonzero_when_the_server_dies(tmp_path):
    server = subprocess.Popen(python_module("psparse.server", "--workers", "2", "--port", "0",
                                            "--out", str(tmp_path), "--timeout", "60"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (tmp_path / "server.port").is_file():
        time.sleep(0.05)
    port = (tmp_path / "server.port").read_text().strip()
    workers = [subprocess.Popen(python_module("psparse.training.loop", "--rank", str(r),
                                              "--workers", "2", "--model", "mlp",
                                              "--dataset", "digits",
                                              "--iterations", "1000000", "--timeout", "3",
                                              "--connect", f"127.0.0.1:{port}"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for r in range(2)]
    try:
        _wait_for_metrics(tmp_path / "metrics.jsonl")
        server.kill()
        t0 = time.monotonic()
        outputs = [w.communicate(timeout=20)[0] for w in workers]
        elapsed = time.monotonic() - t0
    finally:
        for p in (server, *workers):
            if p.poll() is None:
                p.kill()
    assert all(w.returncode == 1 for w in workers), outputs
    assert all("server gone or stalled" in o for o in outputs), outputs
    # noticed within the 3 s timeout, not at communicate's 20 s (margin for a loaded machine)
    assert elapsed < 3 + 10


@pytest.mark.long
def test_lenet_mnist_4_workers_reaches_97_percent_in_2_epochs(tmp_path, data_root):
    r = launch(tmp_path / "run", "--workers", "4", "--model", "lenet", "--dataset", "mnist",
               "--density", "0.01", "--epochs", "2", "--eval-every", "0", timeout=900,
               data_root=data_root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"LeNet/MNIST 4 workers density 1% 2 epochs: test accuracy {summary['test_acc']:.4f}, "
          f"union/k {summary['union_over_k_mean']}, {summary['iterations_per_s']} it/s")
    assert summary["iterations"] == 2 * (60000 // 4 // 32)
    assert summary["test_acc"] >= 0.97


def test_lr_steps_divide_the_learning_rate_by_ten_at_the_given_epochs(tmp_path):
    from psparse.config import ConfigError, RunConfig

    cfg = RunConfig(lr=0.1, lr_steps="2,3").validate()
    assert [cfg.lr_at(e) for e in (0, 1.99)] == [0.1, 0.1]
    assert cfg.lr_at(2) == pytest.approx(0.01) and cfg.lr_at(3.5) == pytest.approx(0.001)
    for bad in ("3,2", "x", "0,1"):
        with pytest.raises(ConfigError, match="lr-steps must be increasing"):
            RunConfig(lr_steps=bad).validate()
    # in a real run: digits, 2 workers, batch 32 -> 23 iterations per epoch; the step at
    # epoch 0.5 (iteration 12) changes the trajectory from there on, not before
    base = ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations", "30",
            "--eval-every", "0", "--density", "1", "--lr", "0.5"]
    for name, extra in (("const", []), ("step", ["--lr-steps", "0.5"])):
        r = launch(tmp_path / name, *base, *extra)
        assert r.returncode == 0, r.stderr
    const = [m["loss"] for m in read_jsonl(tmp_path / "const" / "metrics.jsonl")]
    step = [m["loss"] for m in read_jsonl(tmp_path / "step" / "metrics.jsonl")]
    assert const[:13] == step[:13] and const[14:] != step[14:]
