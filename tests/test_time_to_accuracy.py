"""The time-to-accuracy composition (experiments/time_to_accuracy.py, issue 38): its runs are the
cluster's configurations, its arithmetic, and its premise: a run's training does not depend on
how long it is or how it is evaluated, so iterations to a target measured in a long run on one
machine hold for the shorter cluster run of the same arguments."""

from __future__ import annotations

import pytest
from conftest import read_jsonl, run_launch

from psparse.launch import build_parser
from psparse.options import resolve_config
from psparse.training.loop import native_bf16


def test_accuracy_runs_are_the_cluster_runs_but_for_length_and_evaluation():
    from experiments import time_to_accuracy as tta
    from experiments.cluster_sweep import MODELS, RUNS

    for model in tta.TTA:
        for name in tta.TTA_RUNS:
            long = resolve_config(build_parser().parse_args(
                ["--out", "x", *tta.accuracy_args(model, name)]))
            short = resolve_config(build_parser().parse_args(
                ["--out", "x", *tta.cluster_args(model), *tta.timing_args(model, name)]))
            # as many training steps (a run with local steps H synchronises every H of them)
            h = long.local_steps
            assert h * long.iterations - tta.TTA[model]["iterations"] in range(h), name
            assert long.eval_samples is None  # the whole test set
            differ = {k for k in vars(long) if getattr(long, k) != getattr(short, k)}
            assert differ <= {"iterations", "eval_every", "eval_samples"}, (model, name, differ)
    # LeNet's cluster runs are section 6.2's; ResNet-20's have their own schedule and precision
    assert tta.cluster_args("lenet") == MODELS["lenet"]["base"]
    assert "--amp" in tta.cluster_args("resnet20") and "--channels-last" in tta.cluster_args(
        "resnet20")
    # every timing run is a cluster run; PowerSGD's w1000 runs are timed by their w100 run
    assert set(tta.TIMING_RUNS) <= set(RUNS)
    assert all(tta.timing_of(n) in tta.TIMING_RUNS for n in tta.TTA_RUNS)


def test_composition_counts_iterations_and_splits_a_dense_warm_up():
    from experiments import time_to_accuracy as tta

    evals = [{"iter": 24, "test_acc": 0.95}, {"iter": 49, "test_acc": 0.981},
             {"iter": 74, "test_acc": 0.979}]
    assert tta.iterations_to(evals, 0.98) == 50  # 0-based iteration 49 is the 50th
    assert tta.iterations_to(evals, 0.99) is None
    steady = {"ddp": 200.0, "topk": 50.0, "powersgd-r2": 80.0}
    assert tta.composed_s("topk", 50, steady) == pytest.approx(2.5)
    # PowerSGD warm-up 100: 100 dense iterations at DDP's time, then the compressed ones
    assert tta.composed_s("powersgd-r2-w100", 300, steady) == pytest.approx(20 + 16)
    assert tta.composed_s("powersgd-r2-w100", 60, steady) == pytest.approx(12)
    # after its warm-up a setting runs at the iteration of the same rank compressing from the
    # start (powersgd-r2); without DDP's timing it cannot be composed
    assert tta.composed_s("powersgd-r2-w1000", 1200, steady) == pytest.approx(200 + 16)
    assert tta.composable("powersgd-r2-w1000", steady)
    assert not tta.composable("powersgd-r2-w1000", {"powersgd-r2": 80.0})
    assert not tta.composable("powersgd-r4-w100", steady)
    # the link's share of a round: psparse's server link in then out, a peer's sends
    row = {"server_link_mb": {"rx_bytes": 8.4, "tx_bytes": 46.2}, "iterations": 300,
           "worker_link_mb": {"rx_bytes": 133.4, "tx_bytes": 120.0}}
    assert tta.link_ms("topk", row, "80mbit") == pytest.approx(54.6e6 * 8 / 80e6 / 300 * 1e3)
    assert tta.link_ms("ddp", row, "25mbit") == pytest.approx(120e6 * 8 / 25e6 / 300 * 1e3)


def test_records_give_the_two_factors_of_the_limit(tmp_path, monkeypatch):
    from experiments import time_to_accuracy as tta

    def acc(name, per_seed):
        return [{"run": name, "seed": s, "to": {"0.98": n}, "code": "c1"}
                for s, n in enumerate(per_seed)]

    runs = {"ddp": acc("ddp", [400, 500, 600]), "topk": acc("topk", [600, 750, 900]),
            "ddp-fp16": acc("ddp-fp16", [400, 500, 600])}
    steady = {"ddp": 200.0, "topk": 60.0, "ddp-fp16": 120.0}
    rows = {"topk": {"compute_ms": 40.0, "code_id": "c2"}}
    _, recs = tta.records("lenet", "25mbit", 0.98, runs, steady, rows, "abc")
    (r,) = recs
    assert r["best_peer"] == "ddp-fp16" and r["psparse_run"] == "topk"
    assert r["iterations_vs_dense"] == pytest.approx(1.5)
    assert r["iteration_time_vs_compute"] == pytest.approx(1.5)
    assert r["vs_limit"] == pytest.approx(2.25) and r["sd_vs_limit"] == pytest.approx(0.0)
    assert r["vs_ddp"] == pytest.approx(1.5 * 60 / 200)
    assert r["vs_best_peer"] == pytest.approx(1.5 * 60 / 120)
    assert r["dense_ring_share"] == pytest.approx(0.8)
    assert r["seeds"] == [0, 1, 2] and r["report_commit"] == "abc"
    assert r["commit"] == "c1" and r["timing_commit"] == "c2"


@pytest.mark.long
def test_report_keeps_recorded_accuracy_runs_whose_folders_are_gone(tmp_path, monkeypatch,
                                                                      capsys):
    """A fresh checkout has no runs/tta/: the report takes each missing run's record from the
    detail JSON it wrote last time (a run is bit-reproducible), so a new timing block can be
    composed with it; a record without evaluations stays out of the figure, saying so."""
    import json

    from experiments import time_to_accuracy as tta

    monkeypatch.setattr(tta, "RESULTS", tmp_path)
    monkeypatch.setattr(tta, "ROOT", tmp_path)  # no runs/ there
    evals = [{"iter": 99, "test_acc": 0.97}, {"iter": 199, "test_acc": 0.985}]
    runs = [{"run": "topk", "seed": 0, "code": "c1", "to": {"0.98": 200}, "evals": evals},
            {"run": "ddp", "seed": 0, "code": "c1", "to": {"0.98": 300}}]  # an older record
    (tmp_path / "time-to-accuracy-detail.json").write_text(json.dumps({"runs": runs}))
    got = tta.recorded_runs()
    assert got[("lenet", "topk", 0)]["to"] == {"0.98": 200} and len(got) == 2
    assert "float_kernels" not in got[("lenet", "topk", 0)]  # an older record: not recorded
    steady = {"topk": 60.0, "ddp": 200.0}
    monkeypatch.setattr(tta, "timings", lambda model, rate: (
        steady, {"topk": {"compute_ms": 40.0, "code_id": "c2"}}))
    monkeypatch.setattr(tta, "split_table", lambda rate, rows, steady: "")
    monkeypatch.setattr(tta, "validation", lambda *a: [])
    tta.report(["lenet"])
    out = capsys.readouterr().out
    assert "2 accuracy runs not in runs/tta/, their recorded results kept: topk-s0, ddp-s0" in out
    assert "ddp is not in the figure" in out and "topk is not in the figure" not in out
    assert "topk-s0, ddp-s0 were made on other or unrecorded float kernels" in out
    (rec,) = [r for r in json.loads((tmp_path / "time-to-accuracy.json").read_text())
                if r["rate"] == "80mbit"]
    assert rec["psparse_run"] == "topk" and rec["vs_ddp"] == pytest.approx(200 * 60 / 300 / 200)
    assert rec["commit"] == "c1" and rec["timing_commit"] == "c2"
    detail = json.loads((tmp_path / "time-to-accuracy-detail.json").read_text())
    assert [r["run"] for r in detail["runs"]] == ["topk", "ddp"]  # kept for the next report
    assert detail["runs"][0]["evals"] == evals
    assert set(detail["float_kernels"]) == {"onednn_max_cpu_isa", "torch_capability",
                                            "onednn_isa"}  # this machine's
    assert all("float_kernels" not in r for r in detail["runs"])  # kept as they were recorded
    # a record that names this machine's kernels is kept without the warning
    for r in detail["runs"]:
        r["float_kernels"] = detail["float_kernels"]
    (tmp_path / "time-to-accuracy-detail.json").write_text(json.dumps(detail))
    tta.report(["lenet"])
    out = capsys.readouterr().out
    assert "their recorded results kept" in out and "float kernels" not in out
    assert (tmp_path / "tta-lenet-80mbit.png").is_file()


def test_training_does_not_depend_on_length_or_evaluation(tmp_path):
    """The premise of the composition, on real runs: 12 iterations evaluated on a subset every
    4 equal the first 12 of 24 evaluated on the whole test set every 6 (losses, checksums)."""
    base = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--seed", "1",
            "--quiet", "--check-every", "4", "--policy", "vote", "--density", "0.05"]
    short, long = tmp_path / "short", tmp_path / "long"
    for out, extra in ((short, ["--iterations", "12", "--eval-every", "4",
                                "--eval-samples", "100"]),
                       (long, ["--iterations", "24", "--eval-every", "6"])):
        r = run_launch("--out", str(out), *base, *extra, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    keep = ("iter", "loss", "upload_bytes", "broadcast_entries")
    a = [{k: m.get(k) for k in keep} for m in read_jsonl(short / "metrics.jsonl")]
    b = [{k: m.get(k) for k in keep} for m in read_jsonl(long / "metrics.jsonl")][:12]
    assert len(a) == 12 and a == b
    assert read_jsonl(short / "eval.jsonl")[0]["iter"] == 3  # the 4th iteration's evaluation


def test_the_bf16_grid_is_refused_where_bf16_is_emulated(capsys):
    """ResNet-20's runs train in bf16: on a CPU that emulates it they would take hours, so the
    accuracy stage refuses them there (LeNet's, float32, run anywhere)."""
    from experiments import time_to_accuracy as tta

    assert "emulated" in tta.bf16_refusal(["lenet", "resnet20"], native=False)
    assert tta.bf16_refusal(["resnet20"], native=True) is None
    assert tta.bf16_refusal(["lenet"], native=False) is None
    if not native_bf16():  # this machine: the real refusal, before anything starts
        assert tta.main(["--only", "resnet20", "--stage", "accuracy", "--runs", "ddp",
                         "--seeds", "1"]) == 2
        assert "--any-cpu" in capsys.readouterr().err


def test_the_transformer_row_composes_its_dense_warm_up_and_times_what_it_trains():
    from experiments import transformer_tta as tt

    # the cluster runs are the accuracy runs but for length and evaluation
    for name, args in tt.RUNS.items():
        if name not in tt.TIMING_ARGS:  # a warm-up run: timed as its two phases (below)
            assert tt.warmup_of(name) and tt.twin_of(name) in tt.TIMING_ARGS
            continue
        long = resolve_config(build_parser().parse_args(
            ["--out", "x", *tt.BASE, *args, "--iterations", str(tt.ITERATIONS)]))
        short = resolve_config(build_parser().parse_args(
            ["--out", "x", *tt.BASE, "--iterations", str(tt.TIMED), *tt.TIMING_ARGS[name]]))
        differ = {k for k in vars(long) if getattr(long, k) != getattr(short, k)}
        assert differ <= {"iterations"}, (name, differ)
        assert long.model == "gpt" and long.optimizer == "adamw" and long.workers == tt.WORKERS
    # a warm-up's dense iteration is timed with the warm-up run's own options
    for name in tt.RUNS:
        if tt.warmup_of(name):
            args = tt.RUNS[name]
            i = args.index("--dense-warmup")
            warm = resolve_config(build_parser().parse_args(
                ["--out", "x", *tt.BASE, *args[:i], *args[i + 2:], "--density", "1"]))
            dense = resolve_config(build_parser().parse_args(
                ["--out", "x", *tt.BASE, *tt.TIMING_ARGS[tt.dense_of(name)]]))
            assert vars(warm) == vars(dense), name
    evals = [{"iter": 49, "test_loss": 2.4}, {"iter": 99, "test_loss": 1.99},
             {"iter": 149, "test_loss": 2.01}]
    assert tt.iterations_to(evals, 2.0) == 100 and tt.iterations_to(evals, 1.8) is None
    # 60 dense iterations at psparse's dense iteration, the rest at the 1% twin's
    assert tt.twin_of("dense60-local-adam-topk") == "local-adam-topk"
    steady = {tt.DENSE: 900.0, "local-adam-topk": 300.0}
    assert tt.composed_s("dense60-local-adam-topk", 100, steady) == pytest.approx(54 + 12)
    assert tt.composed_s("dense60-local-adam-topk", 40, steady) == pytest.approx(36)
    assert tt.composed_s("local-adam-topk", 100, steady) == pytest.approx(30)
    # a run without a warm-up needs no dense timing (none at 5 Mbit/s for fp32)
    assert tt.composed_s("ddp", 10, {"ddp": 1000.0}) == pytest.approx(10)
    # an int4 run's warm-up is timed as psparse's dense iteration in int4
    assert tt.twin_of("dense60-local-adam-topk-int4") == "local-adam-topk-int4"
    assert tt.dense_of("dense60-local-adam-topk-int4") == tt.DENSE_INT4
    assert tt.dense_of("dense60-local-adam-topk") == tt.DENSE


def test_the_local_steps_comparison_composes_synchronisations_and_names_the_best_diloco():
    """experiments/local_steps.py: seconds = synchronisations to the target x the steady
    synchronisation; steps = synchronisations x H; each ratio against the same seed's run."""
    from experiments import local_steps as ls

    def run(name, seed, syncs, h):
        return {"run": name, "seed": seed, "code": "c", "local_steps": h,
                "syncs_to_target": syncs, "final_acc": 0.985, "best_acc": 0.99,
                "evals": [[(syncs or 10) - 1, 0.98 if syncs else 0.9]]}
    data = {"model": "lenet", "target": 0.98, "machine": "m", "float_kernels":
            {"torch_capability": "AVX2"}, "report_commit": "r",
            "runs": [run("ddp", 0, 400, 1), run("ddp", 1, 300, 1),
                     run("local16-core-int4", 0, 63, 16), run("local16-core-int4", 1, 60, 16),
                     run("diloco-h16", 0, 50, 16), run("diloco-h4", 0, None, 4)],
            "timing": {"25mbit": {n: {"steady_ms": ms, "compute_ms": 8.0 * h, "wait_ms": 1.0,
                                      "code": "c", "syncs_timed": 12}
                                  for n, ms, h in (("ddp", 175.0, 1),
                                                   ("local16-core-int4", 160.0, 16),
                                                   ("diloco-h16", 300.0, 16),
                                                   ("diloco-h4", 200.0, 4))}}}
    rows = {r["run"]: r for r in ls.compose(data)}
    assert set(rows) == {"ddp", "local16-core-int4", "diloco-h16"}  # diloco-h4: not reached
    local = rows["local16-core-int4"]
    assert local["composed_s"] == {0: 63 * 0.160, 1: 60 * 0.160}
    assert local["steps_to_target"] == [63 * 16, 60 * 16]
    assert local["vs_ddp"] == [pytest.approx(63 * 0.160 / (400 * 0.175)),
                               pytest.approx(60 * 0.160 / (300 * 0.175))]
    assert local["best_diloco"] == "diloco-h16" and local["best_peer"] == "diloco-h16"
    assert local["vs_best_diloco"] == [pytest.approx(63 * 0.160 / (50 * 0.300))]  # seed 0 only
    assert local["best_psparse_run"] and not rows["ddp"]["best_psparse_run"]
    assert local["compute_ms_per_step"] == 8.0
    assert "| local16-core-int4 | 16 | 63, 60 | 1008, 960 |" in ls.page(data)


def test_the_resnet20_local_steps_comparison_composes_each_target_and_keeps_lenets_rows(
        tmp_path, monkeypatch):
    """experiments/local_steps.py --model resnet20: a run's synchronisations to each target
    (85% and 80%), composed apart; a run that misses one is named on the page; a run recorded
    on another machine is named with it; writing ResNet-20's rows into time-to-accuracy.json
    leaves LeNet's comparison and the other comparisons' rows as they were."""
    import json

    from experiments import local_steps as ls

    monkeypatch.setattr(ls, "RESULTS", tmp_path)
    others = [{"comparison": "local-steps", "model": "lenet", "run": "localsgd-h16"},
              {"model": "resnet20", "run": "topk", "target": 0.85}]
    (tmp_path / "time-to-accuracy.json").write_text(json.dumps(others))

    def run(name, h, to85, to80, machine="here"):
        return {"run": name, "seed": 0, "code": "c", "machine": machine, "local_steps": h,
                "syncs_to_target": to85, "syncs_to": {"0.85": to85, "0.8": to80},
                "final_acc": 0.86, "best_acc": 0.87, "evals": [[to80 - 1, 0.81]]}
    timing = {"ddp": (3000.0, 1), "local16-dense-int4": (33000.0, 16),
              "localsgd-h16": (34000.0, 16)}
    data = {"model": "resnet20", "target": 0.85, "targets": [0.85, 0.8], "machine": "here",
            "float_kernels": {"torch_capability": "AVX512"}, "report_commit": "r",
            "runs": [run("ddp", 1, 4875, 3510, machine="another CPU"),
                     run("local16-dense-int4", 16, None, 240), run("localsgd-h16", 16, 320, 250)],
            "timing": {"10mbit": {n: {"steady_ms": ms, "compute_ms": 2000.0 * h, "wait_ms": 1.0,
                                      "code": "c", "syncs_timed": 12}
                                  for n, (ms, h) in timing.items()}}}
    at85 = {r["run"]: r for r in ls.compose(data)}
    at80 = {r["run"]: r for r in ls.compose(data, 0.8)}
    assert set(at85) == {"ddp", "localsgd-h16"} and at85["ddp"]["target"] == 0.85
    ours = at80["local16-dense-int4"]
    assert ours["composed_s"] == {0: pytest.approx(240 * 33.0)}
    assert ours["steps_to_target"] == [240 * 16]
    assert ours["vs_ddp"] == [pytest.approx(240 * 33.0 / (3510 * 3.0))]
    assert ours["vs_best_diloco"] == [pytest.approx(240 / 250 * 33 / 34)]
    ls.write(data)
    page = (tmp_path / "local-steps-resnet20.md").read_text()
    assert "### 10mbit, to 85%" in page and "### 10mbit, to 80%" in page
    assert ("Not at 85% within the runs' 30 epochs (5,850 steps, 5,856 at H 16): "
            "local16-dense-int4 seed 0") in page
    assert "ddp seed 0: another CPU" in page and "torchft" not in page
    # under each table, the goal's verdict split into steps and time per step (to 80%:
    # 240 x 16 steps against localsgd's 250 x 16 and DDP's 3,510; 33/16 s a step against
    # 34/16 s and 3 s)
    assert ("psparse's fastest, `local16-dense-int4`: against `localsgd-h16` 0.93× (goal ≤ "
            "0.8×) = 0.96× the steps × 0.97× the time per step, misses it: neither alone "
            "would meet it; against `ddp` 0.75× (goal ≤ 0.5×) = 1.09× the steps × 0.69× the "
            "time per step, misses it: neither alone would meet it.") in page
    assert (tmp_path / "local-steps-resnet20-10mbit.png").is_file()
    # the results page's summary: the fastest of each family per target, the miss named
    from experiments import pages
    monkeypatch.setattr(pages, "RESULTS", tmp_path)
    summary = "\n".join(pages.local_steps_table("resnet20"))
    assert "Not at 85%: `local16-dense-int4`." in summary
    assert "| 10 Mbit/s | psparse, local steps | `local16-dense-int4` | 16 | 80% | 3840 |" in summary
    assert "`local16-dense-int4` | 16 | 85%" not in summary
    rows = json.loads((tmp_path / "time-to-accuracy.json").read_text())
    assert rows[:2] == others
    assert sorted((r["target"], r["run"]) for r in rows[2:]) == [
        (0.8, "ddp"), (0.8, "local16-dense-int4"), (0.8, "localsgd-h16"),
        (0.85, "ddp"), (0.85, "localsgd-h16")]
    # a LeNet record from before several targets were kept: its headline target's count
    legacy = {"syncs_to_target": 22}
    assert ls.syncs_to(legacy, 0.98, {"target": 0.98}) == 22
    assert ls.syncs_to(legacy, 0.9, {"target": 0.98}) is None


def test_what_decides_a_missed_goal_splits_the_paired_ratio_into_steps_and_time_per_step():
    """The verdict under each local-steps table: the composed-time ratio (a mean over seeds of
    paired ratios) is the mean paired steps ratio times the time per step's; a miss is the
    steps' when the time per step alone meets the goal, the time per step's when the steps
    alone do, else neither's."""
    from experiments import local_steps as ls

    def rows(our_steps, our_ms, their_steps, their_ms):
        def row(name, steps, ms, h, psparse):
            return {"run": name, "best_psparse_run": psparse, "best_diloco": "diloco-h16",
                    "local_steps": h, "steady_ms_per_sync": ms * h,
                    "composed_s": {s: n * ms / 1e3 for s, n in enumerate(steps)}}
        ours = row("vote2-int4", our_steps, our_ms, 1, True)
        theirs = row("diloco-h16", their_steps, their_ms, 16, False)
        ours["vs_best_diloco"] = [ours["composed_s"][s] / theirs["composed_s"][s]
                                  for s in ours["composed_s"]]
        ours["vs_ddp"] = []  # DDP not timed here: its half is left out
        return [ours, theirs]
    steps_miss = ls.what_decides(rows([3200], 400.0, [1280], 1000.0))[0]
    assert "1.00× (goal ≤ 0.8×) = 2.50× the steps × 0.40× the time per step, misses it: " \
           "steps decide." in steps_miss and "`ddp`" not in steps_miss
    time_miss = ls.what_decides(rows([1000], 1000.0, [2000], 400.0))[0]
    assert "= 0.50× the steps × 2.50× the time per step, misses it: time per step decides" \
        in time_miss
    # two seeds, steps 0.9x and 1.1x theirs: the mean ratio 1.00 is 1.00x the steps x 1.00x
    paired = ls.what_decides(rows([900, 1100], 500.0, [1000, 1000], 500.0))[0]
    assert "1.00× (goal ≤ 0.8×) = 1.00× the steps × 1.00× the time per step, misses it: " \
           "neither alone would meet it." in paired
    met = ls.what_decides(rows([1000], 300.0, [1000], 500.0))[0]
    assert "0.60× (goal ≤ 0.8×) = 1.00× the steps × 0.60× the time per step, meets the goal" in met
    assert ls.what_decides([{**rows([1], 1.0, [1], 1.0)[0], "vs_best_diloco": []}]) == []
