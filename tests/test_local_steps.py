"""--local-steps H: H optimizer steps on each worker's own data, then the pseudo-gradient goes
through the exchange and every rank applies the aggregate with the outer (Nesterov) step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import data_dir, python_module, read_jsonl, run_launch, start_launch

from psparse.config import ConfigError, RunConfig

REPO = Path(__file__).resolve().parent.parent
LOCAL_SGD = ["--outer-lr", "1", "--outer-momentum", "0"]  # the outer step: averaging
RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--seed", "4", "--quiet"]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


def checksums(run_dir, n):
    return [json.loads((run_dir / f"rank-{r}.json").read_text())["checksum"] for r in range(n)]


def test_one_local_step_with_the_identity_outer_step_is_todays_run(tmp_path):
    """H = 1 with the outer step plain SGD at learning rate 1 is the per-iteration exchange,
    bit for bit: the same metrics, evaluations and final weights."""
    common = [*RUN, "--iterations", "60", "--eval-every", "20", "--policy", "core"]
    today = run_launch("--out", str(tmp_path / "today"), *common, timeout=300)
    assert today.returncode == 0, today.stderr
    one = run_launch("--out", str(tmp_path / "one"), *common, "--local-steps", "1",
                     "--outer-lr", "1", "--outer-momentum", "0", timeout=300)
    assert one.returncode == 0, one.stderr
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(tmp_path / "one" / name)) == \
            without_timing(read_jsonl(tmp_path / "today" / name)), name
    assert checksums(tmp_path / "one", 3) == checksums(tmp_path / "today", 3)


def reference_diloco(cfg: RunConfig, syncs: int) -> dict[str, torch.Tensor]:
    """DiLoCo as the paper describes it, dense, in one process: every rank takes H steps of
    its optimizer on its own batches, the pseudo-gradients θ_sync − θ_r are averaged, and
    SGD with Nesterov momentum (torch.optim.SGD) steps θ_sync with that average."""
    from psparse.training.loop import setup

    ranks = [setup(cfg, r) for r in range(cfg.workers)]  # (data, shard, model, opt, device)
    anchor_model = ranks[0][2]
    anchor = [p.detach().clone() for p in anchor_model.parameters()]
    outer_params = [torch.nn.Parameter(a.clone()) for a in anchor]
    outer = torch.optim.SGD(outer_params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=True)
    for it in range(syncs):
        deltas = []
        for _, shard, model, opt, _ in ranks:
            for step in range(it * cfg.local_steps, (it + 1) * cfg.local_steps):
                x, y = shard.batch(step)
                opt.zero_grad(set_to_none=False)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            deltas.append([a - p.detach() for a, p in zip(anchor, model.parameters())])
        for p, *ds in zip(outer_params, *deltas):
            p.grad = sum(ds) / cfg.workers
        outer.step()
        anchor = [p.detach().clone() for p in outer_params]
        for _, _, model, _, _ in ranks:
            with torch.no_grad():
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
    return {name: p.detach() for name, p in anchor_model.named_parameters()}


def test_dense_local_steps_are_diloco(tmp_path, server_factory, data_root):
    """Standalone server and two worker processes at density 1: the final weights are the
    reference DiLoCo's (to float32 rounding of the mean), and both ranks hold the same bits."""
    n, syncs = 2, 6
    opts = ["--workers", str(n), "--model", "mlp", "--dataset", "digits", "--density", "1",
            "--local-steps", "3", "--outer-lr", "0.7", "--outer-momentum", "0.9",
            "--iterations", str(syncs), "--check-every", "1", "--eval-every", "0",
            "--threads", "1", "--data-dir", str(data_root)]
    server = server_factory(n)
    workers = [subprocess.Popen(python_module(
        "psparse.training.loop", "--rank", str(r), "--connect", f"127.0.0.1:{server.port}",
        "--save-weights", str(tmp_path / f"w{r}.pt"), *opts),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outputs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0] * n, outputs
    assert server.wait()[0] == 0
    assert len(server.metrics()) == syncs  # one round per synchronisation
    states = [torch.load(tmp_path / f"w{r}.pt") for r in range(n)]
    cfg = RunConfig(workers=n, model="mlp", dataset="digits", density=1.0, local_steps=3,
                    outer_lr=0.7, outer_momentum=0.9, iterations=syncs, threads=1,
                    data_dir=str(data_root)).validate()
    expected = reference_diloco(cfg, syncs)
    for name, want in expected.items():
        assert torch.equal(states[0][name], states[1][name]), name
        assert torch.allclose(states[0][name], want, rtol=0, atol=2e-6), name
    torch.manual_seed(cfg.seed)
    from psparse.training.loop import setup
    initial = dict(setup(cfg, 0)[2].named_parameters())
    assert any(not torch.allclose(initial[k], v) for k, v in expected.items())


def test_sparse_quantized_local_steps_keep_every_rank_identical(tmp_path):
    """core at 5% with int4 values, the outer step local SGD's (lr 1, no momentum: with SGD
    momentum as the inner optimizer DiLoCo's outer momentum overshoots on this small model):
    checksums after every synchronisation (the server stops a run whose replicas differ), one
    round per synchronisation, the loss going down."""
    out = tmp_path / "run"
    r = run_launch("--out", str(out), *RUN, "--local-steps", "4", "--iterations", "50",
                   "--policy", "core", "--density", "0.05", "--values", "int4",
                   "--check-every", "1", "--eval-every", "25", "--lr", "0.1",
                   "--outer-lr", "1", "--outer-momentum", "0", timeout=300)
    assert r.returncode == 0, r.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["iter"] for m in metrics] == list(range(50))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert len(set(checksums(out, 3))) == 1
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["iter"] for e in evals] == [24, 49]  # synchronisations, each of 4 batches
    assert evals[1]["epoch"] == pytest.approx(2 * evals[0]["epoch"], abs=1e-3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["test_acc"] > 0.5


def test_a_run_resumed_at_a_synchronisation_equals_an_uninterrupted_one(tmp_path):
    run = [*RUN, "--local-steps", "4", "--iterations", "120", "--checkpoint-every", "30",
           "--eval-every", "30", "--density", "0.05"]
    whole = run_launch("--out", str(tmp_path / "whole"), *run, timeout=300)
    assert whole.returncode == 0, whole.stderr
    cut = tmp_path / "cut"
    proc = start_launch("--out", str(cut), *run)
    deadline = time.monotonic() + 120
    while not ((cut / "checkpoint" / "server-60.pt").is_file()
               and len(read_jsonl(cut / "metrics.jsonl")) >= 65):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and len(read_jsonl(cut / "metrics.jsonl")) < 120
    resumed = run_launch("--resume", str(cut), "--quiet", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at iteration" in (cut / "logs" / "server.log").read_text()
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(cut / name)) == \
            without_timing(read_jsonl(tmp_path / "whole" / name)), name
    assert checksums(cut, 3) == checksums(tmp_path / "whole", 3)


@pytest.mark.parametrize("options, words", [
    ({"local_steps": 0}, "local-steps must be a whole number >= 1"),
    ({"outer_lr": 0.5}, "outer step of --local-steps H >= 2"),
    ({"local_steps": 4, "outer_momentum": 1.0}, "outer-momentum must be in [0, 1)"),
    ({"local_steps": 4, "memory": "dgc"}, "would apply momentum or Adam to them a second time"),
    ({"local_steps": 4, "overlap": True, "granularity": "layer"}, "does not work with --overlap"),
])
def test_options_local_steps_refuse(options, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")
                       .replace("(", r"\(")):
        RunConfig(**options).validate()


def test_the_launcher_names_a_bad_local_steps_option(tmp_path):
    r = run_launch("--out", str(tmp_path / "x"), *RUN, "--outer-lr", "0.5", timeout=60)
    assert r.returncode == 2 and "outer step of --local-steps H >= 2" in r.stderr


def script_run(out: Path, script: str, *args: str, options=()) -> tuple[int, dict]:
    r = run_launch("--workers", "2", "--quiet", "--local-steps", "4", "--outer-lr", "1",
                   "--outer-momentum", "0", *options, "--out", str(out),
                   str(REPO / "tests" / script), *args, timeout=300,
                   env={**os.environ, "PSPARSE_DATA": str(data_dir())})
    return r.returncode, json.loads((out / "summary.json").read_text())


@pytest.mark.long
def test_a_users_loop_with_local_step_trains_and_the_wrong_call_is_named(tmp_path):
    code, summary = script_run(tmp_path / "ok", "user_local_steps.py", "30",
                               options=["--density", "0.05"])
    assert code == 0 and summary["status"] == "ok" and summary["iterations"] == 30
    assert summary["test_acc"] > 0.6  # chance is 0.1; 120 local steps of 16 images, 30 syncs
    ranks = [json.loads((tmp_path / "ok" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    code, summary = script_run(tmp_path / "wrong", "user_local_steps.py", "30", "exchange")
    assert code != 0 and "call ps.local_step(loss) after every optimizer.step()" in \
        summary["error"], summary["error"]
    code, summary = script_run(tmp_path / "hook", "user_ddp_one_line.py", "8")
    assert code != 0 and "the DDP comm hook is handed gradients" in summary["error"]


@pytest.mark.long
def test_the_allreduce_peer_is_the_same_algorithm(tmp_path):
    """--baseline ddp --local-steps: DiLoCo over torch.distributed; dense, its losses are
    psparse's dense local steps' to float32 rounding (the mean: a ring's sum order, not the
    server's), synchronisation by synchronisation."""
    common = [*RUN, "--local-steps", "3", "--iterations", "12", "--density", "1",
              "--eval-every", "0"]
    ps = run_launch("--out", str(tmp_path / "ps"), *common, timeout=300)
    peer = run_launch("--out", str(tmp_path / "peer"), *common, "--baseline", "ddp",
                      timeout=300)
    assert ps.returncode == 0 and peer.returncode == 0, ps.stderr + peer.stderr
    summary = json.loads((tmp_path / "peer" / "summary.json").read_text())
    assert summary["baseline"] == "diloco-olr0.7-om0.9-h3 (gloo)"
    ps_loss = [m["loss"] for m in read_jsonl(tmp_path / "ps" / "metrics.jsonl")]
    peer_rows = read_jsonl(tmp_path / "peer" / "metrics.jsonl")
    assert len(peer_rows) == 12 and ps_loss == pytest.approx([m["loss"] for m in peer_rows],
                                                             rel=1e-4)
    assert peer_rows[0]["allreduce_bytes"] == 2 * 2 * 2410 * 4  # 2 (N-1)/N x 4 numel x N


def test_local_steps_on_the_gpu_path_are_the_hosts_with_one_copy_back_a_round(tmp_path):
    """The strict emulated device (no host read of a device value mid-iteration): the same
    weights as the host path, one copy back per synchronisation, no reads."""
    args = [*RUN, "--workers", "2", "--iterations", "8", "--local-steps", "3", "--policy",
            "core", "--eval-every", "4", "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k != "PSPARSE_EMULATE_GPU"}
    host = run_launch("--out", str(tmp_path / "host"), *args, timeout=300, env=env)
    device = run_launch("--out", str(tmp_path / "device"), *args, timeout=300,
                        env={**env, "PSPARSE_EMULATE_GPU": "strict"})
    assert host.returncode == 0 and device.returncode == 0, host.stderr + device.stderr
    for r in range(2):
        d = json.loads((tmp_path / "device" / f"rank-{r}.json").read_text())
        h = json.loads((tmp_path / "host" / f"rank-{r}.json").read_text())
        assert d["checksum"] == h["checksum"]
        assert d["device"]["copy_backs_per_iteration"] == 1.0 and d["device"]["reads"] == 0


def test_fp16_local_steps_keep_their_scaler_local_and_ranks_identical(tmp_path):
    """--amp fp16: each worker's GradScaler skips its own overflowing local steps; the
    synchronisations still leave every rank with the same weights."""
    out = tmp_path / "run"
    r = run_launch("--out", str(out), *RUN, "--amp", "fp16", "--local-steps", "4",
                   "--iterations", "20", "--density", "0.05", "--check-every", "1",
                   *LOCAL_SGD, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(set(checksums(out, 3))) == 1
    loss = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
    assert loss[-1] < loss[0]


@pytest.mark.long
def test_an_elastic_run_with_local_steps_goes_on_without_a_lost_worker(tmp_path):
    code, summary = script_run(tmp_path / "run", "user_local_steps.py", "30", "lose",
                               options=["--workers", "3", "--elastic", "--timeout", "5"])
    assert code == 0 and summary["status"] == "ok", summary
    assert summary["lost_workers"] and summary["lost_workers"][0]["rank"] == 2
    ranks = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"] and ranks[0]["iterations"] == 30
