"""Issue 38: time to accuracy, composed from two measurements that do not depend on each other.

    python -m experiments.time_to_accuracy --only lenet           # make exp-tta (LeNet, ~50 min)
    python -m experiments.time_to_accuracy --only lenet --stage accuracy --runs topk,ddp --seeds 1,2
    python -m experiments.time_to_accuracy --stage report         # tables from what has run
    python -m experiments.time_to_accuracy --only resnet20 --stage status   # the grid at a glance

A run is bit-reproducible: its accuracy after iteration t does not depend on the network or
the hosts' CPU (the arithmetic is the same; only the clock differs). So

    time to a target = (iterations to the target, from a full-length run on this machine)
                     x (the steady iteration on the emulated cluster, same arguments and code)

Stages (``--stage``, default all in this order):

* ``accuracy``: full-length runs on this machine (runs/tta/<model>/<run>-s<seed>), the cluster's
  arguments but the length, evaluated on the whole test set; iterations to each target are the
  first evaluation at or above it (evaluations every ``eval_every`` iterations: the count is
  known to that grain).
* ``validate``: the same runs at exactly the cluster runs' arguments (runs/tta/<model>-check/),
  to check the composition against the cluster runs' directly measured time to
  ``VALIDATE_TARGET`` (net of evaluations), and that their evaluations are identical to the
  cluster runs' (the premise above).
* ``timing``: the cluster runs (experiments/cluster.py's ``run_one``, runs/cluster/...), seed
  0: the steady iteration (the mean after 3 warm-up iterations, evaluations left out), its
  split, link bytes and the server's CPU per round.
* ``report``: experiments/results/time-to-accuracy.{md,json} and tta-<model>-<rate>.png.

Two stages that run nothing, for a grid made piece by piece (ResNet-20's accuracy runs take
~20-45 min each on 2 cores: run them in the background from a worktree pinned to one commit):
``status`` lists every accuracy run of the grid as done, recorded, running, stopped, failed or
missing, with its iterations and best evaluation; ``record`` copies the finished ones' results
(config, summary, evaluations, gzipped metrics, the machine; no checkpoints) to
experiments/results/tta-runs/<model>/<run>-s<seed>/ for committing, then rewrites the results
page (experiments/pages.py), and a report on a fresh checkout reads them where runs/tta/ has
none.

Composition of a run with a dense warm-up (PowerSGD's ``start_powerSGD_iter`` W): W iterations
at DDP's steady iteration, the rest at the steady iteration of the same rank compressing from
iteration 2 (``powersgd-r<R>``) -- composed from measured parts, labelled so in the table, and
checked against the cluster runs of ``powersgd-r<R>-w100``, which have both phases.

The compute-only limit of a (model, rate, target): the dense run's (DDP's, same seed)
iterations to the target x the compute time per iteration on these hosts (the mean over the
psparse runs of ranks 1-7's compute per iteration; compute does not depend on the exchange).
A run's time over that limit is the product of two factors the report gives apart: its
iterations over the dense run's (accuracy per iteration) and its median iteration over the
compute time (the round above compute).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from experiments.cluster_report import measure, numel_and_shapes, run_dir
from experiments.cluster_sweep import MODELS, PEER_RUNS, PSPARSE_RUNS, RUNS, local_steps_of
from experiments.figures import pyplot, save
from experiments.harness import RESULTS, ROOT, RunCache, RunDir, md_table, mean_sd
from psparse.provenance import float_kernels, provenance
from psparse.training.loop import EMULATED_BF16, native_bf16
from psparse.wire.transport import parse_rate

VALIDATE_TARGET = 0.9  # LeNet: the target the composition is checked at, against direct times

# Per model: the accuracy runs' length and evaluation grain (whole test set), the targets, the
# rates of the cluster timing runs. LeNet: 1,000 iterations (4.3 epochs; DDP reaches 98% in
# 300-500), cluster_sweep's arguments. ResNet-20 (issue 50): its own arguments, for the
# accuracy and the cluster runs alike -- 30 epochs (5,850 iterations of 8 x 32 images) with a
# 2-epoch linear warm-up then cosine, lr 0.2 (0.1 per 128 images, the ResNet paper's, scaled
# linearly), Nesterov, weight decay 5e-4, bf16 autocast and channels-last batches (2.5x faster
# steps; docs/notes/cluster-time-to-accuracy.md has the schedule's figures), evaluated every epoch;
# the cluster runs 100 iterations of the same; a third rate, 100 Mbit/s, where DDP's ring is a
# small part of an iteration.
RESNET20_BASE = ["--workers", "8", "--model", "resnet20", "--dataset", "cifar10",
                 "--batch-size", "32", "--lr", "0.2", "--momentum", "0.9", "--nesterov",
                 "--weight-decay", "5e-4", "--lr-schedule", "cosine", "--warmup-epochs", "2",
                 "--amp", "bf16", "--channels-last", "--threads", "1"]
TTA = {
    "lenet": {"iterations": 1000, "eval_every": 25, "targets": [0.98],
              "rates": ["80mbit", "25mbit"]},
    "resnet20": {"iterations": 5850, "eval_every": 195, "targets": [0.8, 0.85],
                 "rates": ["40mbit", "10mbit", "100mbit"], "base": RESNET20_BASE,
                 "cluster": ["--iterations", "100", "--eval-every", "25", "--eval-samples",
                             "1000"]},
}
# three seeds: the runs the ratios are means over (topk, the best rule, DDP, the best peer:
# LeNet's were core and the bf16 hook; ResNet-20's may differ: add them with --seeds 1,2 --runs X)
THREE_SEEDS = ("topk", "core", "vote", "ema-int4", "vote2-int4", "ddp", "ddp-fp16", "ddp-bf16")
# the runs of a comparison: psparse's, DDP, its compression hooks, PowerSGD's warm-up grid
TTA_RUNS = ["topk", "core", "vote", "ema-int4", "vote2-int4", "ddp", "ddp-fp16", "ddp-bf16", "powersgd-r2-w100",
            "powersgd-r2-w1000", "powersgd-r4-w100", "powersgd-r4-w1000"] + \
    [n for n in RUNS if local_steps_of(n) > 1]  # issue 55: local steps, DiLoCo, local SGD
# the cluster timing runs: a PowerSGD setting is composed from DDP's iteration and the same
# rank's compressed one (powersgd-rR, compressing from iteration 2); the w100 runs are timed too,
# to check that composition against a run that has both phases
TIMING_RUNS = [r for r in TTA_RUNS if not r.endswith("-w1000")] + ["powersgd-r2", "powersgd-r4"]
PEERS = [r for r in TTA_RUNS if r in PEER_RUNS]


def warmup_of(name: str) -> int | None:
    """PowerSGD's dense warm-up in iterations (None: no warm-up phase)."""
    args = RUNS[name]
    return int(args[args.index("--powersgd-warmup") + 1]) if "--powersgd-warmup" in args \
        else None


def timing_of(name: str) -> str:
    """The cluster run whose iterations give ``name``'s iteration time after its warm-up:
    powersgd-rR-wW's is powersgd-rR's (compressed from iteration 2)."""
    return name.split("-w")[0] if warmup_of(name) is not None else name


def cluster_args(model: str) -> list[str]:
    """The cluster runs' base arguments (with their length and evaluation options)."""
    spec = TTA[model]
    return spec["base"] + spec["cluster"] if "base" in spec else MODELS[model]["base"]


def base_args(model: str) -> list[str]:
    """The cluster runs' base arguments without their length and evaluation options."""
    base, out = cluster_args(model), []
    skip = False
    for a in base:
        if skip:
            skip = False
        elif a in ("--iterations", "--eval-every", "--eval-samples"):
            skip = True  # and its value
        else:
            out.append(a)
    return out


def accuracy_args(model: str, name: str) -> list[str]:
    """The accuracy run's arguments: as long in training steps as the others (a run with local
    steps H: 1/H as many synchronisations, evaluated every ~eval_every steps)."""
    spec, h = TTA[model], local_steps_of(name)
    return base_args(model) + RUNS[name] + [
        "--iterations", str(math.ceil(spec["iterations"] / h)),
        "--eval-every", str(max(1, round(spec["eval_every"] / h)))]


def timing_args(model: str, name: str) -> list[str]:
    """The cluster run's arguments of ``name``: a run with local steps H does 1/H of the
    cluster runs' steps in synchronisations, at least 12 (3 are left out as the cold start),
    evaluated only at the end (every synchronisation would be an evaluation's round)."""
    h = local_steps_of(name)
    if h == 1:
        return RUNS[name]
    steps = int(cluster_args(model)[cluster_args(model).index("--iterations") + 1])
    return RUNS[name] + ["--iterations", str(max(12, math.ceil(steps / h))), "--eval-every", "0"]


def bf16_refusal(models: list[str], native: bool) -> str | None:
    """Why this CPU cannot run these models' accuracy runs, or None: ResNet-20's grid trains
    in bf16, ~35 minutes a run with AVX512-BF16 or AMX and hours where bf16 is emulated (its
    floats would come from other kernels than the recorded runs' too)."""
    if native or not any("bf16" in TTA[m].get("base", []) for m in models):
        return None
    return f"{EMULATED_BF16}. The grid's bf16 runs need such a CPU (--any-cpu runs them here anyway)"


def launch_local(out: Path, args: list[str], seed: int, data_dir: str | None) -> Path:
    """One run on this machine (reused when these arguments finished there before)."""
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet", *args,
           "--seed", str(seed)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    cache = RunCache(out, run_identity(args, seed, data_dir))
    if cache.finished():
        return out
    print(f"[tta] {out.relative_to(ROOT)} ...", flush=True)
    cache.start(fresh=True)
    r = subprocess.run(cmd, cwd=ROOT)
    cache.finish()
    print(f"[tta] {out.relative_to(ROOT)}: exit {r.returncode}", flush=True)
    return out


def run_identity(args: list[str], seed: int, data_dir: str | None) -> list[str]:
    """What a local run's cache (RunCache) knows it by: the launcher's arguments after
    --out and --quiet."""
    return [*args, "--seed", str(seed), *(["--data-dir", data_dir] if data_dir else [])]


def accuracy_dir(model: str, name: str, seed: int) -> Path:
    return ROOT / "runs" / "tta" / model / f"{name}-s{seed}"


def check_dir(model: str, name: str) -> Path:
    return ROOT / "runs" / "tta" / f"{model}-check" / f"{name}-s0"


def iterations_to(evals: list[dict], target: float) -> int | None:
    """Iterations done at the first evaluation at or above ``target`` (eval.jsonl's ``iter``
    is the 0-based index of the iteration it follows)."""
    return next((e["iter"] + 1 for e in evals if e["test_acc"] >= target), None)


def steady_ms(out: Path, after: int = 3) -> float:
    """Mean training iteration (ms) of a cluster run from iteration ``after`` on: the steps
    that hold rank 0's evaluation are left out (each stops the round for seconds on a sixth of
    a core; a training run needs none) and so is the cold start before ``after``. The mean,
    not the median: a time to target is a sum of iterations, and on CPU shares the slow ones
    (a host throttled at its quota's end) are part of it."""
    run = RunDir(out)
    metrics = run.metrics()
    evaluated = {e["iter"] for e in run.evals()}
    steps = [b["time_s"] - a["time_s"] for a, b in zip(metrics, metrics[1:])]
    return 1e3 * statistics.mean(x for j, x in enumerate(steps)
                                 if j >= after and j not in evaluated)


def composable(name: str, timing: dict[str, float]) -> bool:
    """Whether the cluster runs that time ``name`` are there (and DDP's, for a warm-up)."""
    return timing_of(name) in timing and (warmup_of(name) is None or "ddp" in timing)


def composed_s(name: str, iterations: int, timing: dict[str, float]) -> float:
    """Seconds to do ``iterations`` of run ``name`` at its measured steady iteration times."""
    warmup = warmup_of(name)
    if warmup is None:
        return iterations * timing[name] / 1e3
    dense = min(iterations, warmup)
    return (dense * timing["ddp"] + (iterations - dense) * timing[timing_of(name)]) / 1e3


def timings(model: str, rate: str) -> tuple[dict[str, float], dict[str, dict]]:
    """(run -> steady ms per iteration, run -> cluster_report's row) of one rate's cluster runs,
    seed 0; PowerSGD's timing runs give their compressed iterations' mean (after warm-up)."""
    _, shapes = numel_and_shapes(model)
    steady, rows = {}, {}
    for name in TIMING_RUNS:
        out = run_dir(model, rate, name, 0)
        if not (out / "summary.json").is_file():
            continue
        row = measure(out, name, rate, [VALIDATE_TARGET], shapes)
        if "failed" in row:
            continue
        rows[name] = row
        warmup = warmup_of(name)
        steady[name] = steady_ms(out, 3 if warmup is None else warmup + 3)
    return steady, rows


# The accuracy runs' recorded files, committed as they finish (``--stage record``): config,
# summary, evaluations and the gzipped metrics of each, enough for a report on a fresh checkout
RECORDED = "tta-runs"  # under RESULTS (read at call time: a test points RESULTS elsewhere)
RECORDED_FILES = ("config.json", "summary.json", "eval.jsonl")


def recorded_dir(model: str, name: str, seed: int) -> Path:
    return RESULTS / RECORDED / model / f"{name}-s{seed}"


def record_run(model: str, name: str, seed: int) -> Path:
    """Copy a finished accuracy run's results (not its checkpoints or logs) to
    experiments/results/tta-runs/<model>/<run>-s<seed>/, metrics.jsonl gzipped."""
    import gzip
    import shutil

    src, dst = accuracy_dir(model, name, seed), recorded_dir(model, name, seed)
    dst.mkdir(parents=True, exist_ok=True)
    for f in RECORDED_FILES:
        shutil.copyfile(src / f, dst / f)
    with open(src / "metrics.jsonl", "rb") as fin, \
            gzip.GzipFile(dst / "metrics.jsonl.gz", "wb", mtime=0) as fout:
        shutil.copyfileobj(fin, fout)
    # the machine that made it (the results page names it; runs are recorded where they ran)
    (dst / "machine.json").write_text(json.dumps(
        {"cpu": this_machine(), "float_kernels": float_kernels()}, indent=2) + "\n")
    return dst


def this_machine() -> str:
    """'<CPU model>, <n> cores' from /proc/cpuinfo (the CPU's flags say which float kernels)."""
    import os

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def accuracy_record(model: str, name: str, seed: int) -> dict | None:
    """A finished accuracy run's record: from runs/tta/, else from its recorded files."""
    return accuracy_record_at(accuracy_dir(model, name, seed), name, seed, model) or \
        accuracy_record_at(recorded_dir(model, name, seed), name, seed, model)


def accuracy_record_at(out: Path, name: str, seed: int, model: str) -> dict | None:
    run = RunDir(out)
    summary = run.summary()
    if not summary or summary.get("status") != "ok":
        return None
    evals = run.evals()
    return {"run": name, "seed": seed, "code": run.code_id(), "evals": evals,
            "final_acc": summary["test_acc"], "best_acc": max(e["test_acc"] for e in evals),
            "to": {f"{t:g}": iterations_to(evals, t) for t in TTA[model]["targets"]}}


def validation(model: str, rate: str, steady: dict[str, float], rows: dict[str, dict]) -> list:
    """Per cluster run: composed (this machine's iterations to VALIDATE_TARGET x the cluster's
    steady iteration) against the cluster run's own time to it net of evaluations, and whether
    the two runs' evaluations are the same numbers."""
    out = []
    for name, row in rows.items():
        check = RunDir(check_dir(model, name))
        if not check.summary() or not composable(name, steady):
            continue
        n = iterations_to(check.evals(), VALIDATE_TARGET)
        direct = row["to_target"][f"{VALIDATE_TARGET:g}"]["train_time_to_target_s"]
        cluster_evals = [(e["iter"], e["test_acc"]) for e in RunDir(run_dir(model, rate, name, 0)).evals()]
        local_evals = [(e["iter"], e["test_acc"]) for e in check.evals()]
        composed = composed_s(name, n, steady) if n is not None else None
        out.append({"rate": rate, "run": name, "iterations": n, "composed_s": composed,
                    "direct_s": direct, "identical_evals": cluster_evals == local_evals,
                    "error": composed / direct - 1 if composed and direct else None})
    return out


def records(model: str, rate: str, target: float, acc: dict[str, list[dict]],
            steady: dict[str, float], rows: dict[str, dict], commit: str) -> tuple[list, list]:
    """(table lines, time-to-accuracy.json records) of one (model, rate, target)."""
    key = f"{target:g}"
    compute_ms = statistics.mean(rows[n]["compute_ms"] for n in PSPARSE_RUNS if n in rows)
    ddp_seed = {r["seed"]: r["to"][key] for r in acc.get("ddp", [])}
    composed = {}  # run -> {seed: seconds}
    for name, seeds in acc.items():
        if not composable(name, steady):
            continue
        composed[name] = {r["seed"]: composed_s(name, r["to"][key], steady)
                          for r in seeds if r["to"][key] is not None}
    mean = lambda name: np.mean(list(composed[name].values())) if composed.get(name) \
        else float("inf")  # noqa: E731
    peers = [n for n in composed if n in PEERS and composed[n]]
    psparse = [n for n in composed if n in PSPARSE_RUNS and composed[n]]
    best_peer = min(peers, key=mean, default=None)
    best_ps = min(psparse, key=mean, default=None)
    lines, out = [], []
    body = []
    for name in composed:
        its = [r["to"][key] for r in acc[name]]
        reached = [x for x in its if x is not None]
        limit = {s: ddp_seed[s] * compute_ms / 1e3 for s in composed[name]
                 if ddp_seed.get(s) is not None}
        vs_limit = [composed[name][s] / limit[s] for s in limit]
        vs_ddp = [composed[name][s] / composed["ddp"][s] for s in composed[name]
                  if s in composed.get("ddp", {})]
        vs_peer = [composed[name][s] / composed[best_peer][s] for s in composed[name]
                   if best_peer and s in composed[best_peer]]
        step = steady.get(name) if warmup_of(name) is None else None
        h = local_steps_of(name)  # > 1: iterations are synchronisations of h steps
        per_seed = ", ".join("-" if x is None else str(x) for x in its) + \
            (f" syncs of {h} steps" if h > 1 else "")
        body.append([name, len(its), f"{per_seed} ({mean_sd(reached, '.0f')})" +
                     (f", {len(its) - len(reached)} not reached" if len(reached) < len(its)
                      else ""),
                     f"composed: {warmup_of(name)} at ddp's, then {timing_of(name)}'s "
                     f"{steady[timing_of(name)]:.1f}" if warmup_of(name) else "measured",
                     f"{step:.1f}" if step else "-", mean_sd(composed[name].values(), ".1f"),
                     mean_sd(vs_limit), mean_sd(vs_ddp), mean_sd(vs_peer)])
        if name in psparse:
            ddp_its = [ddp_seed[s] for s in composed[name] if ddp_seed.get(s)]
            out.append({
                "model": model, "rate": rate, "target": target,
                "dense_ring_share": 1 - compute_ms / steady["ddp"] if "ddp" in steady else None,
                "psparse_run": name, "best_psparse_run": name == best_ps, "local_steps": h,
                "vs_limit": float(np.mean(vs_limit)) if vs_limit else None,
                "sd_vs_limit": float(np.std(vs_limit, ddof=1)) if len(vs_limit) > 1 else None,
                "vs_ddp": float(np.mean(vs_ddp)) if vs_ddp else None,
                "sd_vs_ddp": float(np.std(vs_ddp, ddof=1)) if len(vs_ddp) > 1 else None,
                "vs_best_peer": float(np.mean(vs_peer)) if vs_peer else None,
                "sd_vs_best_peer": float(np.std(vs_peer, ddof=1)) if len(vs_peer) > 1 else None,
                "best_peer": best_peer,
                "best_peer_local_steps": local_steps_of(best_peer) if best_peer else None,
                # training steps (a synchronisation is h of them) over DDP's
                "iterations_vs_dense": float(h * np.mean(reached) / np.mean(ddp_its))
                if reached and ddp_its else None,
                "iteration_time_vs_compute": step / compute_ms if step else None,
                "seeds": sorted(composed[name]),
                # the code of its accuracy runs and of its cluster timing run, and the report's
                "commit": ",".join(sorted({r["code"] or "not recorded" for r in acc[name]})),
                "timing_commit": rows.get(name, {}).get("code_id"), "report_commit": commit})
    lines += [f"### {model}, {rate}, to {100 * target:g}%", "",
              f"Compute per iteration on these hosts: {compute_ms:.1f} ms; "
              f"best psparse run `{best_ps}`, best peer `{best_peer}`.", "",
              md_table(["run", "seeds", f"iterations to {100 * target:g}% (per seed; mean ± SD)",
                        "iteration time", "steady ms/it", "composed s", "vs compute-only limit", "vs DDP",
                        "vs best peer"], body), ""]
    return lines, out


def figure(model: str, rate: str, acc: dict[str, list[dict]], steady: dict[str, float]) -> Path:
    """Test accuracy against composed wall time (seed 0), every run of the comparison."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, seeds in acc.items():
        if not composable(name, steady):
            continue
        r = next((r for r in seeds if r["seed"] == 0), None)
        if r is None or not r.get("evals"):
            print(f"[tta] {model} {rate}: {name} is not in the figure (no seed-0 evaluations "
                  "recorded)", flush=True)
            continue
        xs = [composed_s(name, e["iter"] + 1, steady) for e in r["evals"]]
        ax.plot(xs, [100 * e["test_acc"] for e in r["evals"]], label=name,
                lw=2 if name in PSPARSE_RUNS else 1, ls="-" if name in PSPARSE_RUNS else "--")
    for t in TTA[model]["targets"]:
        ax.axhline(100 * t, color="grey", lw=0.5)
    lo = 100 * min(TTA[model]["targets"]) - 8
    ax.set_ylim(lo, 100 if model == "lenet" else 95)
    ax.set_xlabel(f"composed wall time, s (iterations x the {rate} cluster's steady iteration)")
    ax.set_ylabel("test accuracy, % (whole test set)")
    ax.set_title(f"{model}, {rate}, seed 0")
    ax.legend(fontsize=7)
    return save(fig, RESULTS / f"tta-{model}-{rate}.png")


def recorded_runs() -> dict[tuple, dict]:
    """(model, run, seed) -> the accuracy record the last report kept in its detail JSON. A run
    is bit-reproducible on the same machine and kernel set, so its record stands for its
    folder when runs/tta/ is gone (a fresh checkout); each record names the code and the float
    kernels that made it (``float_kernels``; absent in records before they were kept), and on
    other float kernels the same code trains to other numbers (docs/api.md, Determinism)."""
    path = RESULTS / "time-to-accuracy-detail.json"
    if not path.is_file():
        return {}
    return {(r.get("model", "lenet"), r["run"], r["seed"]): r
            for r in json.loads(path.read_text())["runs"]}


def report(models: list[str]) -> None:
    commit = provenance()["code_id"]
    lines = [f"Made by `{commit}` (the report); each run's own commit is in its config.json "
             "and in the JSON beside this file.", ""]
    kernels = float_kernels()  # this machine's: the accuracy runs in runs/tta/ were made here
    data = {"records": [], "validation": [], "runs": [], "float_kernels": kernels}
    recorded = recorded_runs()
    for model in models:
        acc: dict[str, list[dict]] = {}
        kept, foreign = [], []
        for name in TTA_RUNS:
            for seed in range(3):
                rec = accuracy_record(model, name, seed)
                if rec is not None:
                    rec["float_kernels"] = kernels
                elif (model, name, seed) in recorded:
                    rec = recorded[(model, name, seed)]
                    kept.append(f"{name}-s{seed}")
                    if rec.get("float_kernels") != kernels:
                        foreign.append(f"{name}-s{seed}")
                if rec is not None:
                    acc.setdefault(name, []).append({**rec, "model": model})
        if kept:
            print(f"[tta] {model}: {len(kept)} accuracy runs not in runs/tta/, their recorded "
                  f"results kept: {', '.join(kept)}", flush=True)
        if foreign:
            print(f"[tta] {model}: {', '.join(foreign)} were made on other or unrecorded float "
                  f"kernels (here {kernels}): their counts hold for that machine; runs made "
                  "here would differ", flush=True)
        if not acc:
            continue
        # the evaluations kept as (iteration, accuracy): enough for the figures and the counts
        data["runs"] += [{**r, "evals": [{"iter": e["iter"], "test_acc": e["test_acc"]}
                                         for e in r["evals"]]} if r.get("evals") else r
                         for rs in acc.values() for r in rs]
        for rate in TTA[model]["rates"]:
            steady, rows = timings(model, rate)
            if not steady:
                continue
            checks = validation(model, rate, steady, rows)
            data["validation"] += checks
            for target in TTA[model]["targets"]:
                part, recs = records(model, rate, target, acc, steady, rows, commit)
                lines += part
                data["records"] += recs
            lines += split_table(rate, rows, steady), ""
            if checks:
                lines += [f"Composition check at {rate}, to {100 * VALIDATE_TARGET:g}%:", "",
                          md_table(["run", "iterations", "composed s", "direct s", "error",
                                    "evaluations identical"],
                                   [[c["run"], c["iterations"], f"{c['composed_s']:.1f}",
                                     f"{c['direct_s']:.1f}", f"{c['error']:+.1%}",
                                     c["identical_evals"]] for c in checks
                                    if c["error"] is not None]), ""]
            figure(model, rate, acc, steady)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "time-to-accuracy.md").write_text("\n".join(lines))
    (RESULTS / "time-to-accuracy.json").write_text(json.dumps(data["records"], indent=1))
    (RESULTS / "time-to-accuracy-detail.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))


def split_table(rate: str, rows: dict[str, dict], steady: dict[str, float]) -> str:
    """Per cluster run: the iteration's split, the link's share of it, the bytes on every
    host's link, the server's CPU per round (by thread), the cold first iteration and the cost
    model's error."""
    body = []
    for name, r in rows.items():
        body.append([name, f"{r['first_iteration_ms']:.0f}", f"{steady[name]:.1f}",
                     f"{r['median_ms']:.1f}",
                     f"{r['compute_ms']:.1f}", f"{r['select_ms']:.1f}", f"{r['wait_ms']:.1f}",
                     f"{link_ms(name, r, rate):.1f}",
                     f"{r.get('server_cpu_ms', float('nan')):.1f}", thread_split(r),
                     f"{r['server_link_mb']['rx_bytes']:.1f} / {r['server_link_mb']['tx_bytes']:.1f}",
                     f"{r['worker_link_mb']['rx_bytes']:.1f} / {r['worker_link_mb']['tx_bytes']:.1f}",
                     f"{r['model_error']:+.1%}" if "model_error" in r else "-"])
    return (f"Cluster runs at {rate} (seed 0, {rows and next(iter(rows.values()))['iterations']}"
            " iterations): per iteration, ms\n\n" +
            md_table(["run", "first it. (cold)", "steady (mean)", "median", "compute", "select",
                      "wait", "link (bytes / rate)", "server CPU", "server CPU: main u+s / ZeroMQ I/O u+s",
                      "server link MB in / out",
                      "worker link MB in / out", "cost model error"], body))


def link_ms(name: str, row: dict, rate: str) -> float:
    """The link's share of a round, ms: the bytes the round's critical link carried (headers
    included) over the rate. psparse: the server's, in + out -- an upper bound, since the link
    is full duplex and the early workers' next pushes come in while the broadcast still goes
    out to the others; the peers: a worker's sends (its ring steps send and receive at once)."""
    if name in PSPARSE_RUNS:
        nbytes = row["server_link_mb"]["rx_bytes"] + row["server_link_mb"]["tx_bytes"]
    else:
        nbytes = row["worker_link_mb"]["tx_bytes"]
    return 1e3 * nbytes * 1e6 * 8 / parse_rate(rate) / row["iterations"]


def thread_split(row: dict) -> str:
    """The server's CPU per round by thread, user + system ("-" where not sampled: runs made
    before the per-thread samples, and the peers, which have no server)."""
    t = row.get("server_threads_ms") or {}
    if not t:
        return "-"
    return (f"{t.get('main_user', 0):.1f}+{t.get('main_system', 0):.1f} / "
            f"{t.get('io_user', 0):.1f}+{t.get('io_system', 0):.1f}")


def wanted_seeds(name: str, seeds: str | None) -> list[int]:
    """The accuracy stage's seeds of run ``name``: --seeds, else 0-2 for THREE_SEEDS, else 0."""
    if seeds:
        return [int(s) for s in seeds.split(",")]
    return [0, 1, 2] if name in THREE_SEEDS else [0]


def grid_status(model: str, names: list[str], seeds: str | None,
                data_dir: str | None) -> list[list[str]]:
    """Per accuracy run of the grid: done (ended with its summary, these arguments), running
    (started with them and still writing: metrics.jsonl changed in the last 10 minutes),
    stopped (started, not ended, silent since) or missing; the iterations so far and the
    best evaluation."""
    import time

    rows = []
    for name in names:
        for seed in wanted_seeds(name, seeds):
            out = accuracy_dir(model, name, seed)
            cache = RunCache(out, run_identity(accuracy_args(model, name), seed, data_dir))
            run = RunDir(out)
            metrics = out / "metrics.jsonl"
            done = len(run.metrics()) if metrics.is_file() else 0
            if cache.finished():
                state = "done" if (run.summary() or {}).get("status") == "ok" else "failed"
                if state == "done" and (recorded_dir(model, name, seed) / "summary.json").is_file():
                    state = "done, recorded"
            elif cache.started():
                recent = metrics.is_file() and time.time() - metrics.stat().st_mtime < 600
                state = "running" if recent else "stopped"
            elif (recorded_dir(model, name, seed) / "summary.json").is_file():
                state, run = "recorded", RunDir(recorded_dir(model, name, seed))
                done = (run.summary() or {}).get("iterations") or 0
            else:
                state = "missing"
            evals = run.evals() if run.path.is_dir() else []
            best = max((e["test_acc"] for e in evals), default=None)
            rows.append([name, str(seed), state, f"{done}/{TTA[model]['iterations']}",
                         "-" if best is None else f"{100 * best:.2f}%"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.time_to_accuracy",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="lenet", help="models (lenet, resnet20; default lenet)")
    p.add_argument("--stage", default="accuracy,validate,timing,report",
                   help="comma-separated stages to run, in this order (default all); "
                        "record copies the finished accuracy runs' results (config, summary, "
                        "evaluations, gzipped metrics) to experiments/results/tta-runs/ for "
                        "committing; status lists the grid's accuracy runs as done, recorded, "
                        "running, stopped, failed or missing (record and status run nothing)")
    p.add_argument("--runs", default=",".join(TTA_RUNS),
                   help="runs of the accuracy stage (default every one of the comparison; "
                        "the timing stage runs those of them that have cluster runs)")
    p.add_argument("--seeds", default=None,
                   help="accuracy stage seeds (default: 0, 1, 2 for "
                        f"{', '.join(THREE_SEEDS)}, 0 for the others)")
    p.add_argument("--rates", default=None,
                   help="timing stage link rates (default the model's: LeNet 80mbit,25mbit; "
                        "ResNet-20 40mbit,10mbit,100mbit); a rate's runs replace its earlier "
                        "ones in runs/cluster/<model>-<rate>/ unless those finished with the "
                        "same arguments and code")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    p.add_argument("--any-cpu", action="store_true",
                   help="run bf16 accuracy runs (ResNet-20's) on a CPU that emulates bf16 too "
                        "(about 10-15x slower, and other float kernels than the recorded runs')")
    args = p.parse_args(argv)
    models, stages = args.only.split(","), args.stage.split(",")
    names = args.runs.split(",")
    if "record" in stages:  # the finished accuracy runs' results into experiments/results/
        recorded_any = False
        for model in models:
            for name in names:
                for seed in wanted_seeds(name, args.seeds):
                    rec = accuracy_record_at(accuracy_dir(model, name, seed), name, seed, model)
                    if rec is not None:
                        print(f"[tta] recorded {record_run(model, name, seed).relative_to(ROOT)}"
                              f": best {100 * rec['best_acc']:.2f}%, to targets {rec['to']}")
                        recorded_any = True
        if recorded_any and RESULTS == ROOT / "experiments" / "results":
            from experiments import pages  # the results page's ResNet-20 table reads records
            pages.main([])
    if "status" in stages:  # at a glance: which accuracy runs are done, running or missing
        for model in models:
            rows = grid_status(model, names, args.seeds, args.data_dir)
            print(f"{model}: " + ", ".join(f"{sum(r[2] == s for r in rows)} {s}" for s in
                                           ("done", "done, recorded", "recorded", "running",
                                            "stopped", "failed", "missing")))
            print(md_table(["run", "seed", "state", "iterations", "best evaluation"], rows))
        return 0
    why = "accuracy" in stages and not args.any_cpu and bf16_refusal(models, native_bf16())
    if why:
        print(f"[tta] {why}", file=sys.stderr)
        return 2
    for model in models:
        if "accuracy" in stages:  # every run's seed 0 first: a comparison as early as it can
            for seed in range(3):
                for name in names:
                    if seed in wanted_seeds(name, args.seeds):
                        launch_local(accuracy_dir(model, name, seed),
                                     accuracy_args(model, name), seed, args.data_dir)
        if "validate" in stages:
            for name in names:
                if name in TIMING_RUNS and local_steps_of(name) == 1:
                    launch_local(check_dir(model, name), cluster_args(model) + RUNS[name], 0,
                                 args.data_dir)
        if "timing" in stages:
            from experiments.cluster import emulated_cluster, run_one
            code_id = provenance()["code_id"]
            # the requested runs that have cluster runs, and those that time a requested
            # PowerSGD warm-up setting after its warm-up (powersgd-rR for powersgd-rR-wW)
            timed = [n for n in TIMING_RUNS
                     if n in names or any(timing_of(m) == n for m in names)]
            for rate in args.rates.split(",") if args.rates else TTA[model]["rates"]:
                with emulated_cluster(rate) as hosts:
                    for name in timed:
                        run_one(model, rate, name, hosts, code_id, False, args.data_dir,
                                base=cluster_args(model), run_args=timing_args(model, name))
    if "report" in stages:
        report(models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
