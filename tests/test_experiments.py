"""Every run of every experiment sweep is a valid psparse-launch configuration."""

from __future__ import annotations

import pytest

from experiments.run import SWEEPS
from psparse.config import resolve_config
from psparse.launch import build_parser
from psparse.policies import Layout, build_policy


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_sweep_runs_parse_and_validate(sweep):
    runs = SWEEPS[sweep]["runs"]
    assert runs
    for name, args in runs.items():
        parsed = build_parser().parse_args(["--out", "x", *SWEEPS[sweep]["base"], *args])
        cfg = resolve_config(parsed)
        build_policy(cfg.policy, cfg.policy_args, Layout([100]), 5)  # parameters accepted
        assert cfg.workers == 8, name


def test_lenet_sweep_covers_the_issue():
    runs = SWEEPS["lenet-mnist"]["runs"]
    assert "dense" in runs and "ddp" in runs and len(runs) == 2 + 2 * 2 * 9
    assert "core-d0.001-limit2k" in runs and "topk-d0.01" in runs


def test_a_sweep_runs_reuses_finished_runs_and_draws_its_figure(tmp_path, monkeypatch, capsys):
    """experiments.run end to end on a tiny real sweep: table, figure, and a second call that
    reuses the finished runs instead of running them again."""
    from experiments import figures, run

    for module in (run, figures):
        monkeypatch.setattr(module, "ROOT", tmp_path)
        monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setitem(run.SWEEPS, "time-to-accuracy", {
        "base": ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations",
                 "30", "--eval-every", "10", "--threads", "1"],
        "runs": {"dense": ["--density", "1"], "topk-d0.05": ["--density", "0.05"]},
        "target": 0.5,
    })
    assert run.main(["time-to-accuracy"]) == 0
    out = capsys.readouterr().out
    assert out.count("seed 0 ...") == 2
    table = (tmp_path / "results" / "time-to-accuracy.md").read_text()
    assert "| dense | 1 |" in table and "| topk-d0.05 | 1 |" in table and "s to 50%" in table
    png = tmp_path / "results" / "time-to-accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run.main(["time-to-accuracy"]) == 0
    assert "seed 0 ..." not in capsys.readouterr().out  # reused


def test_cluster_sweep_runs_parse_and_name_the_peers():
    from experiments import cluster

    assert {"topk", "core", "vote", "topk-limit2k", "ddp", "powersgd-r1",
            "powersgd-r4"} <= set(cluster.RUNS)
    for model, spec in cluster.MODELS.items():
        assert len(spec["rates"]) == 2, model
        for name, args in cluster.RUNS.items():
            parsed = build_parser().parse_args(["--out", "x", *spec["base"], *args])
            cfg = resolve_config(parsed)
            assert cfg.workers == cluster.WORKERS, name
            if name.startswith("powersgd"):
                assert parsed.baseline == "powersgd" and parsed.powersgd_rank == int(name[-1])


def test_cpu_per_iteration_leaves_out_evaluations():
    from experiments.cluster import cpu_per_iteration

    # server 2 ms and workers 10 / 12 ms of CPU per iteration; an evaluation at iteration 10
    # (rank 0's 5 s of CPU) falls between the stretches and is not counted
    samples, cpu = [], {"1": 0.0, "2": 0.0, "3": 0.0}
    for it in range(0, 20):
        if it == 10:
            cpu["2"] += 5.0
        samples.append({"t": it, "iters": it, "procs": {
            "1": ["server", cpu["1"]], "2": ["worker", cpu["2"]], "3": ["worker", cpu["3"]],
            "9": ["launcher", 0.0]}})
        cpu = {"1": cpu["1"] + 0.002, "2": cpu["2"] + 0.010, "3": cpu["3"] + 0.012}
    got = cpu_per_iteration(samples, 20, 10)
    assert got["server_ms"] == pytest.approx(2.0)
    assert got["worker_ms_mean"] == pytest.approx(11.0)
    assert got["worker_ms_max"] == pytest.approx(12.0)
    assert cpu_per_iteration(samples[:1], 20, 10) is None


def test_a_finished_run_by_other_code_is_not_reused_unless_told(tmp_path):
    import json

    from experiments.cluster import reusable

    identity = {"args": ["--workers", "8"], "rate": "25mbit"}
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "command.json").write_text(json.dumps(identity))
    (tmp_path / "config.json").write_text(json.dumps({"provenance": {"code_id": "abc"}}))
    assert reusable(tmp_path, identity, "abc", reuse_any=False)
    assert not reusable(tmp_path, identity, "def", reuse_any=False)
    assert reusable(tmp_path, identity, "def", reuse_any=True)
    assert not reusable(tmp_path, {**identity, "rate": "80mbit"}, "abc", reuse_any=True)


def test_config_json_records_the_code_and_reads_back(tmp_path):
    from psparse.config import load_config_file
    from psparse.provenance import provenance

    p = provenance()
    assert set(p) == {"git_commit", "git_dirty", "code_id", "psparse_version"}
    (tmp_path / "config.json").write_text(
        '{"workers": 3, "provenance": {"git_commit": "x"}, "baseline": "powersgd", '
        '"powersgd_rank": 1}')
    assert load_config_file(tmp_path / "config.json") == {"workers": 3}
