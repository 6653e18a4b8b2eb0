"""Every run of every experiment sweep is a valid psparse-launch configuration."""

from __future__ import annotations

import pytest

from experiments.run import SWEEPS
from psparse.launch import build_parser
from psparse.options import resolve_config
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


@pytest.mark.long
def test_a_sweep_runs_reuses_finished_runs_and_draws_its_figure(tmp_path, monkeypatch, capsys):
    """experiments.run end to end on a tiny real sweep: table, figure, and a second call that
    reuses the finished runs instead of running them again."""
    from experiments import figures, run

    for module in (run, figures):
        monkeypatch.setattr(module, "ROOT", tmp_path)
        monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setitem(run.SWEEPS, "paced-100mbit", {
        "base": ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations",
                 "30", "--eval-every", "10", "--threads", "1"],
        "runs": {"dense": ["--density", "1"], "topk-d0.05": ["--density", "0.05"]},
        "target": 0.5,
    })
    assert run.main(["paced-100mbit"]) == 0
    out = capsys.readouterr().out
    assert out.count("seed 0 ...") == 2
    table = (tmp_path / "results" / "paced-100mbit.md").read_text()
    assert "| dense | 1 |" in table and "| topk-d0.05 | 1 |" in table and "s to 50%" in table
    png = tmp_path / "results" / "paced-100mbit.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # total bytes against a dense ring allreduce (2 workers: each sends numel x 4 B): dense
    # exchange through the server moves twice that, plus message headers
    import json

    rows = {r["run"]: r for r in json.loads((tmp_path / "results" /
                                              "paced-100mbit.json").read_text())}
    assert rows["dense"]["allreduce_bytes_per_iteration"] == 2 * rows["dense"]["numel"] * 4
    assert 2.0 < rows["dense"]["sent_over_allreduce"] < 2.1
    assert rows["topk-d0.05"]["sent_over_allreduce"] < 0.5
    assert "| up + bcast, % of allreduce |" in table
    from psparse.provenance import provenance

    assert f"Made by one code version: {provenance()['code_id']}." in table
    # the cifar-lenet figures from these runs: per density, against iterations and against MB
    # broadcast, a run with two seeds drawn as their mean
    named = [{**rows["dense"]}, {**rows["topk-d0.05"], "run": "topk-d0.01"},
             {**rows["topk-d0.05"], "run": "topk-d0.01", "seed": 1}]
    drawn = figures.build("cifar-lenet", "cl", named)
    assert sorted(p.name for p in drawn) == sorted(
        f"cl-d{d}-{x}.png" for d in ("0.01", "0.001") for x in ("iterations", "broadcast"))
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in drawn)
    tradeoff = figures.low_density_tradeoff(named, tmp_path / "tradeoff.png")
    assert tradeoff.read_bytes()[:4] == b"\x89PNG"
    assert run.main(["paced-100mbit"]) == 0
    assert "seed 0 ..." not in capsys.readouterr().out  # reused
    # --report: the finished runs' table, a run not made yet named and not started
    run.SWEEPS["paced-100mbit"]["runs"]["topk-d0.1"] = ["--density", "0.1"]
    assert run.main(["paced-100mbit", "--report", "--stem", "report"]) == 0
    assert "seed 0 ..." not in capsys.readouterr().out
    report = (tmp_path / "results" / "report.md").read_text()
    assert "| dense | 1 |" in report and "| topk-d0.05 | 1 |" in report
    assert "Not finished yet (1): topk-d0.1-s0." in report
    assert not (tmp_path / "runs" / "paced-100mbit" / "topk-d0.1-s0").exists()
    assert "epochs to within 1 pt of best" in report
    assert all(r["epochs_to_near_best"] is not None for r in json.loads(
        (tmp_path / "results" / "report.json").read_text()))


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
            if name.startswith("powersgd"):  # powersgd-rR (warm-up 2) or powersgd-rR-wW
                rank, _, warmup = name[len("powersgd-r"):].partition("-w")
                assert parsed.baseline == "powersgd" and parsed.powersgd_rank == int(rank)
                assert parsed.powersgd_warmup == (int(warmup) if warmup else 2)
            if name.startswith("ddp-"):
                assert parsed.baseline == name[len("ddp-"):]


def test_cpu_per_iteration_leaves_out_evaluations():
    from experiments.cluster_report import cpu_per_iteration

    # server 2 ms and workers 10 / 12 ms of CPU per iteration; an evaluation at iteration 10
    # (rank 0's 5 s of CPU) falls between the stretches and is not counted
    samples, cpu = [], {"1": 0.0, "2": 0.0, "3": 0.0}
    for it in range(0, 20):
        if it == 10:
            cpu["2"] += 5.0
        samples.append({"t": it, "iters": it, "procs": {
            "1": ["server", cpu["1"]], "2": ["worker", cpu["2"]], "3": ["worker", cpu["3"]],
            "9": ["launcher", 0.0]},
            # the server's 2 ms: 1.5 in its main thread (1.2 user), 0.5 in ZeroMQ's (system)
            "server_threads": {"main_user": 0.0012 * it, "main_system": 0.0003 * it,
                               "io_system": 0.0005 * it}})
        cpu = {"1": cpu["1"] + 0.002, "2": cpu["2"] + 0.010, "3": cpu["3"] + 0.012}
    got = cpu_per_iteration(samples, 20, 10)
    assert got["server_ms"] == pytest.approx(2.0)
    assert got["server_threads_ms"] == pytest.approx(
        {"io_system": 0.5, "main_system": 0.3, "main_user": 1.2})
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
    from psparse.options import load_config_file
    from psparse.provenance import provenance

    p = provenance()
    assert set(p) == {"git_commit", "git_dirty", "code_id", "psparse_version"}
    (tmp_path / "config.json").write_text(
        '{"workers": 3, "provenance": {"git_commit": "x"}, "baseline": "powersgd", '
        '"powersgd_rank": 1}')
    assert load_config_file(tmp_path / "config.json") == {"workers": 3}


def test_cifar_lenet_sweep_covers_the_issue():
    """Issue 16: LeNet-5 on CIFAR-10 to convergence, 8 workers, densities 1% and 0.1%, the
    issue's policies, three seeds for dense, top-k, core, vote and ema, checkpoints to resume."""
    from experiments.run import SWEEPS

    sweep = SWEEPS["cifar-lenet"]
    cfg = resolve_config(build_parser().parse_args(["--out", "x", *sweep["base"]]))
    assert (cfg.model, cfg.dataset, cfg.workers, cfg.epochs) == ("lenet", "cifar10", 8, 30)
    assert cfg.lr_step_epochs() == [20, 27] and cfg.checkpoint_every == cfg.eval_every == 195
    policies = ("topk", "frequency", "ema", "penalty", "core", "vote", "cltk")
    assert set(sweep["runs"]) == {"dense"} | {f"{p}-d{d}" for p in policies
                                              for d in ("0.01", "0.001")}
    three = {n for n, s in sweep["seeds"].items() if s == [0, 1, 2]}
    assert three == {"dense"} | {f"{p}-d{d}" for p in ("topk", "core", "vote", "ema")
                                 for d in ("0.01", "0.001")}
    assert all(sweep["seeds"][n] == [0] for n in set(sweep["runs"]) - three)
    assert sum(len(s) for s in sweep["seeds"].values()) == 33


def test_the_table_shows_sample_sd_and_bytes_over_a_dense_allreduce():
    from experiments.run import dense_allreduce_bytes, table

    # the three top-k seeds of results/policies-topk-core-vote-keep1.5.json
    rows = [{"run": "topk", "seed": s, "test_acc": a, "best_acc": a, "union_k_mean": 6.1,
             "union_k_p95": 6.8, "broadcast_mb": 71.0, "upload_mb": 12.4, "k_mean": 617,
             "ms_per_iteration": 60.0, "time_to_target_s": None, "target_acc": 0.98,
             "sent_over_allreduce": 0.05}
            for s, a in enumerate((0.9875, 0.9765, 0.9815))]
    text = table(rows)
    assert "| topk | 3 | 98.18 ± 0.55 |" in text  # ddof=1; the population SD was 0.45
    assert "| 5.00 |" in text and "2(N-1)/N x numel x 4 B" in text
    assert "Made by one code version: not recorded." in text
    rows[0]["code"] = "abc"
    assert "Made by 2 code versions: abc (topk-s0); not recorded (topk-s1, topk-s2)." in \
        table(rows)
    # a ring allreduce of 61,706 floats among 8 workers: 7/4 x 246,824 B per worker
    assert dense_allreduce_bytes(8, 61706) == 8 * 2 * 7 / 8 * 61706 * 4 == 3455536


@pytest.mark.long
def test_a_stopped_sweep_resumes_its_run_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    """The sweep driver killed mid-run (driver, launcher, server and workers together, as when a
    session ends) continues that run from its newest checkpoint on the next call instead of
    starting it over, and ends with the whole run."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import read_jsonl

    from experiments import figures, run

    tiny = {"base": ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations",
                     "400", "--eval-every", "100", "--checkpoint-every", "100", "--threads",
                     "1"],
            "runs": {"topk-d0.05": ["--density", "0.05"]}}
    code = ("import sys\nfrom pathlib import Path\nfrom experiments import figures, run\n"
            f"for m in (run, figures):\n    m.ROOT = Path({str(tmp_path)!r})\n"
            "    m.RESULTS = m.ROOT / 'results'\n"
            f"run.SWEEPS['tiny'] = {tiny!r}\nsys.exit(run.main(['tiny']))\n")
    repo = Path(run.__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = tmp_path / "runs" / "tiny" / "topk-d0.05-s0"
    deadline = time.monotonic() + 240
    try:
        while not ((out / "checkpoint" / "server-200.pt").is_file()
                   and len(read_jsonl(out / "metrics.jsonl")) >= 230):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the sweep and everything it started
    first = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, first
    stopped_at = len(read_jsonl(out / "metrics.jsonl"))
    assert 230 <= stopped_at < 400
    assert not (out / "command.json").exists() and (out / "started.json").is_file()
    before = (out / "metrics.jsonl").read_text().splitlines()[:200]

    for module in (run, figures):
        monkeypatch.setattr(module, "ROOT", tmp_path)
        monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setitem(run.SWEEPS, "tiny", tiny)
    # --report while it is stopped: nothing finished, the stopped run's progress told
    assert run.main(["tiny", "--report"]) == 0
    assert "resuming" not in capsys.readouterr().out
    partial = (tmp_path / "results" / "tiny-partial.md").read_text()
    assert "No run is finished yet." in partial and "Not finished yet (1)" in partial
    got = json.loads((tmp_path / "results" / "tiny-partial-unfinished.json").read_text())
    assert [(r["run"], r["iterations"], r["finished"]) for r in got] == [
        ("topk-d0.05", stopped_at, False)]
    assert got[0]["epochs"] == round(read_jsonl(out / "eval.jsonl")[-1]["epoch"], 2) > 0
    assert run.ended(got[0]) in ("stopped", "no summary (running, or killed)")
    assert f"| topk-d0.05 | 0 | {run.ended(got[0])} |" in partial
    assert run.main(["tiny"]) == 0
    printed = capsys.readouterr().out
    assert "topk-d0.05 seed 0: resuming at iteration 200 ..." in printed, printed
    assert "resumed at iteration 200" in (out / "logs" / "server.log").read_text()
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["iter"] for m in metrics] == list(range(400))
    assert metrics[:200] == before  # not run again: the first 200 rounds keep their times
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    assert "| topk-d0.05 | 1 |" in (tmp_path / "results" / "tiny.md").read_text()
    assert not list((tmp_path / "results").glob("tiny-partial*"))  # the snapshot is gone
    assert run.main(["tiny"]) == 0
    assert "seed 0" not in capsys.readouterr().out.replace("[tiny]", "")  # finished: reused


def test_cluster_seed_summary_pairs_seeds_and_uses_sample_sd():
    """exp-cluster --seeds: mean ± sample SD over seeds, and psparse ÷ peer per same seed."""
    from experiments import cluster_report

    by_seed, targets = {}, cluster_report.MODELS["lenet"]["targets"]
    for seed in range(3):
        for name, t in (("vote", 10.0 + seed), ("ddp", 20.0), ("powersgd-r1", None)):
            by_seed.setdefault(("80mbit", name), []).append(
                {"run": name, "rate": "80mbit", "seed": seed, "median_ms": 50.0 + seed,
                 "test_acc": 0.9, "to_target": {f"{x:g}": {"train_time_to_target_s": t}
                                                for x in targets}})
    text = cluster_report.seed_summary("lenet", by_seed)
    assert "| 80mbit | vote | 51.0 ± 1.0 (3) | 11.0 ± 1.0 (3) |" in text  # ddof 1
    assert "`vote` ÷ `ddp` = 0.55 ± 0.05 (3)" in text
    assert "3 not reached" in text and "÷ `powersgd-r1`" not in text
    assert cluster_report.seed_summary("lenet", {k: v[:1] for k, v in by_seed.items()}) == ""


def _record(path, sets_per_iteration, numel=100):
    """A selections file as --record-selections writes it, for one worker."""
    import numpy as np

    from psparse.worker.selections import SelectionRecorder

    rec = SelectionRecorder([numel], ["w"])
    grad = np.linspace(1, 2, numel).astype(np.float32)
    for sent in sets_per_iteration:
        sent = np.array(sent)
        rec.record(grad, sent, sent, grad)
    rec.save(path)


def test_scaling_splits_the_union_by_how_many_workers_pushed_each_index(tmp_path):
    from experiments.scaling import exponents, union_parts

    # 3 workers, k = 2; iteration 0: {0,1},{0,2},{0,3} -> 0 by all, 1,2,3 by one (union 4)
    # iteration 1: {5,6},{5,6},{6,7} -> 6 by all, 5 by two, 7 by one (union 3)
    _record(tmp_path / "selections-rank-0.npz", [[0, 1], [5, 6]])
    _record(tmp_path / "selections-rank-1.npz", [[0, 2], [5, 6]])
    _record(tmp_path / "selections-rank-2.npz", [[0, 3], [6, 7]])
    parts = union_parts(tmp_path, 3)
    assert parts == pytest.approx({"all_k": (0.5 + 0.5) / 2, "several_k": (0 + 0.5) / 2,
                                   "one_k": (1.5 + 0.5) / 2})
    with pytest.raises(FileNotFoundError, match="3 selection files for 4 workers"):
        union_parts(tmp_path, 4)
    # bytes growing as N^2 from N = 2 to 4, then as N from 4 to 8: fit and neighbour slopes
    rows = [{"policy": "topk", "workers": n, "b": b} for n, b in ((2, 4.0), (4, 16.0), (8, 32.0))]
    e = exponents(rows, "b")["topk"]
    assert e["neighbours"] == pytest.approx([2.0, 1.0]) and 1.0 < e["fit"] < 2.0


def test_low_density_measures_the_accumulator_and_the_coverage(tmp_path):
    from experiments.low_density import accumulator_measures

    # the recorder's accumulator is the gradient itself here: pushing its 2 largest entries
    # (98, 99) captures all that is due; pushing 0 and 1 captures almost nothing
    _record(tmp_path / "selections-rank-0.npz", [[98, 99], [98, 99]])
    _record(tmp_path / "selections-rank-1.npz", [[0, 1], [0, 1]])
    m = accumulator_measures(tmp_path)
    assert 0.5 < m["captured"] < 0.8 and m["captured"] == m["captured_last"]
    assert m["backlog"] == pytest.approx(1.0)  # ||a|| / ||g|| with a = g
    assert m["coverage"] == pytest.approx(4 / 100)


def test_scaling_and_low_density_runs_parse_and_validate():
    from experiments import low_density, scaling

    configs = [[*scaling.BASE, "--workers", "32", "--iterations", "150", *args]
               for args in scaling.POLICIES.values()]
    configs += [["--workers", "8", *low_density.LENET, *args] for args in low_density.RUNS.values()]
    for args in configs:
        cfg = resolve_config(build_parser().parse_args(["--out", "x", *args]))
        build_policy(cfg.policy, cfg.policy_args, Layout([1000]), 10, world_size=cfg.workers)
    assert set(scaling.ACCURACY_POLICIES) <= set(scaling.POLICIES)


@pytest.mark.long
def test_gpu_sweep_runs_side_by_side_and_reports_what_each_reached(tmp_path, monkeypatch,
                                                                   capsys):
    """experiments.gpu_sweep on real processes (--device cpu standing in for cuda): one run
    finishes, one is stopped at the time limit and reported as reached, the archive holds both
    run directories, and --report rebuilds the same table from the unpacked archive."""
    import json
    import tarfile

    from experiments import gpu_sweep, run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(run.SWEEPS, "tiny", {
        "base": ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--eval-every", "10",
                 "--threads", "1", "--checkpoint-every", "5"],
        "runs": {"short": ["--density", "0.05", "--iterations", "20"],
                 "long": ["--density", "0.05", "--iterations", "1000000"]},
    })
    out = tmp_path / "out"
    code = gpu_sweep.main(["tiny", "--only", "short,long", "--seconds", "25", "--out", str(out),
                           "--extra", "--device cpu --server-device cpu"])
    assert code == 0
    rows = {r["run"]: r for r in json.loads((out / "gpu_sweep.json").read_text())}
    assert rows["short"]["finished"] and rows["short"]["iterations"] == 20
    assert rows["short"]["epochs"] is not None and len(rows["short"]["curve"]) == 2
    # stopped by SIGINT (130), or killed when its launcher outlasted the grace on a busy machine
    assert not rows["long"]["finished"] and rows["long"]["exit"] in run.STOPPED
    assert 0 < rows["long"]["iterations"] < 1_000_000 and rows["long"]["curve"]
    assert rows["long"]["union_k_mean"] >= 1.0 and 0 < rows["long"]["sent_over_allreduce"] < 1
    table = (out / "gpu_sweep.md").read_text()
    assert "| short | 0 | finished |" in table and "| long | 0 | stopped |" in table
    # --checkpoint-every is dropped (a bare machine cannot resume), so nothing to leave out
    config = json.loads((tmp_path / "runs/gpu-tiny/long-s0/config.json").read_text())
    assert config["checkpoint_every"] == 0 and config["device"] == "cpu"
    with tarfile.open(out / "gpu_sweep-runs.tar.gz") as tar:
        names = tar.getnames()
        # the "data" filter where this Python has it (3.11.4 on), else plain (our own archive)
        tar.extractall(tmp_path / "unpacked",
                       **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert "short-s0/metrics.jsonl" in names and "long-s0/eval.jsonl" in names
    assert gpu_sweep.main(["tiny", "--report", str(tmp_path / "unpacked"), "--out",
                           str(tmp_path / "again")]) == 0
    again = {r["run"]: r for r in json.loads((tmp_path / "again/gpu_sweep.json").read_text())}
    for name in ("short", "long"):
        assert {k: v for k, v in again[name].items() if k != "exit"} == \
            {k: v for k, v in rows[name].items() if k != "exit"}


def test_epochs_to_near_best_is_the_first_evaluation_within_one_point():
    from experiments.run import epochs_to_near_best

    evals = [{"epoch": e, "test_acc": a} for e, a in
             [(1, 0.40), (2, 0.589), (3, 0.595), (4, 0.60), (5, 0.58)]]
    assert epochs_to_near_best(evals) == 3  # 0.595 >= 0.60 - 0.01; 0.589 is not
    assert epochs_to_near_best(evals, within=0.02) == 2
    assert epochs_to_near_best(evals[:1]) == 1


def test_reached_reads_a_run_that_is_still_writing(tmp_path):
    """--report's reading of an unfinished run: a line being written is left out (not an
    error), the model's size comes from k and the density when there is no summary yet, and
    a DDP baseline's rounds (no k) count as 100% of the allreduce."""
    import json

    from experiments import run

    sparse = tmp_path / "topk-s0"
    sparse.mkdir()
    (sparse / "config.json").write_text(json.dumps({"density": 0.01,
                                                    "provenance": {"code_id": "abc"}}))
    rounds = [{"iter": i, "workers": 2, "k": [10, 10], "budget": 10, "union": 15 + i,
               "upload_bytes": 100, "broadcast_bytes": 300, "time_s": 0.5 * (i + 1)}
              for i in range(4)]
    (sparse / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rounds) + '{"iter": 4, "work')
    (sparse / "eval.jsonl").write_text('{"iter": 3, "epoch": 0.5, "test_acc": 0.4}\n{"it')
    row = run.reached(sparse, "topk", 0, run.exit_status(sparse))
    assert (row["iterations"], row["epochs"], row["test_acc"]) == (4, 0.5, 0.4)
    assert row["union_k_mean"] == (15 + 16 + 17 + 18) / 4 / 10
    # numel = 10 / 0.01 = 1000; 2 workers' dense ring: 2 x 2(1)/2 x 1000 x 4 B = 8000 B
    assert row["sent_over_allreduce"] == 400 / 8000
    assert run.ended(row) == "no summary (running, or killed)" and row["code"] == "abc"

    ddp = tmp_path / "ddp-s0"
    ddp.mkdir()
    (ddp / "config.json").write_text(json.dumps({"density": 1.0}))
    (ddp / "metrics.jsonl").write_text(json.dumps({"iter": 0, "workers": 2,
                                                   "allreduce_bytes": 8000, "time_s": 1.0}) + "\n")
    (ddp / "summary.json").write_text(json.dumps({"status": "failed",
                                                  "error": "terminated by signal SIGTERM"}))
    row = run.reached(ddp, "ddp", 0, run.exit_status(ddp))
    assert row["sent_over_allreduce"] == 1.0 and run.ended(row) == "stopped"


def test_partitions_measure_the_threshold_controllers_as_exdyna_defines_padding():
    from experiments.partitions import controller_measures

    # 4 workers, budget 100: pushes 40+30+20+20 = 110 (+10%), then 25 each (0%)
    rows = [{"k": [40, 30, 20, 20], "budget": 100}, {"k": [25, 25, 25, 25], "budget": 100}]
    m = controller_measures(rows)
    assert m["density_error"] == pytest.approx(0.05)
    assert m["density_error_abs"] == pytest.approx(0.05)
    assert m["padding"] == pytest.approx((40 * 4 / 110 - 1) / 2)  # max·N/Σk - 1, then 0


def test_partitions_runs_parse_and_validate():
    from experiments import partitions

    for part in partitions.PARTS.values():
        for policy in part["policies"]:
            args = [*part["base"], "--density", part["densities"][0], *partitions.PROBE,
                    *partitions.POLICIES[policy]]
            cfg = resolve_config(build_parser().parse_args(["--out", "x", *args]))
            build_policy(cfg.policy, cfg.policy_args, Layout([61706]), 617,
                         world_size=cfg.workers)  # LeNet's size: exdyna's 1024 blocks fit
            assert cfg.probe_recall == 25
