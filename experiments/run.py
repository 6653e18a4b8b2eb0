"""Run a named experiment sweep with psparse-launch and write its results table.

    python -m experiments.run policies            # every policy, LeNet/MNIST, 8 workers
    python -m experiments.run policies --only core,topk --seeds 0,1,2

Each run's directory lands in runs/<sweep>/<run>-s<seed>/; the table (markdown) and the raw
figures (JSON) in experiments/results/<sweep>.{md,json}. Runs that finished with the same
configuration are reused, and a run stopped part-way continues from its newest checkpoint when
the sweep saves them (--checkpoint-every), so an interrupted sweep resumes where it stopped.
Seeds: --seeds for every run, else the sweep's own per run ("seeds"), else 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments import figures
from psparse import checkpoint
from psparse.provenance import provenance
from psparse.rundir import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"

LENET = ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--density", "0.01",
         "--epochs", "2", "--eval-every", "0"]

# The policies of the LeNet/MNIST sweep, with the parameters measured best at density 1%.
SWEEP_POLICIES = {
    "topk": ["--policy", "topk"],
    "randomk": ["--policy", "randomk"],
    "threshold": ["--policy", "threshold", "--policy-arg", "lam=0.02"],
    "frequency": ["--policy", "frequency"],
    "ema": ["--policy", "ema"],
    "penalty": ["--policy", "penalty", "--policy-arg", "pi=0.1"],
    "cltk": ["--policy", "cltk"],
    "core": ["--policy", "core"],
    "vote": ["--policy", "vote", "--policy-arg", "keep=1.5"],
}


def _lenet_mnist_runs() -> dict[str, list[str]]:
    """Every policy at density 1% and 0.1%, with and without a 2k server limit; dense; DDP."""
    runs = {"dense": ["--density", "1"], "ddp": ["--baseline", "ddp", "--density", "1"]}
    for density in ("0.01", "0.001"):
        for name, args in SWEEP_POLICIES.items():
            runs[f"{name}-d{density}"] = ["--density", density, *args]
            runs[f"{name}-d{density}-limit2k"] = ["--density", density, "--server-limit", "2k",
                                                  *args]
    return runs


# 8 workers x 32 images = 256 per iteration, 195 iterations per epoch.
RESNET20 = ["--workers", "8", "--model", "resnet20", "--dataset", "cifar10", "--batch-size",
            "32", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "1e-4"]


def _resnet20_runs() -> dict[str, list[str]]:
    """Dense, top-k, the best aligning policy (core) and cltk at density 1% and 0.1%."""
    runs = {"dense": ["--density", "1"]}
    for density in ("0.01", "0.001"):
        for name in ("topk", "core", "cltk"):
            runs[f"{name}-d{density}"] = ["--density", density, *SWEEP_POLICIES[name]]
    return runs


# issue 16: dense, top-k and the two aligning rules best on LeNet/MNIST (core, vote) on three
# seeds, the other rules on one; and ema, best of the aligning rules on CIFAR-10's first seed
# (64.7% at 1%, above top-k's 63.4 mean), added on seeds 1 and 2 once that was seen
CIFAR_LENET_POLICIES = ("topk", "frequency", "ema", "penalty", "core", "vote", "cltk")
CIFAR_LENET_THREE_SEEDS = ("topk", "core", "vote", "ema")


def _cifar_lenet_runs() -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    """Dense, and every policy of the issue at density 1% and 0.1%; seeds per run."""
    runs, seeds = {"dense": ["--density", "1"]}, {"dense": [0, 1, 2]}
    for density in ("0.01", "0.001"):
        for name in CIFAR_LENET_POLICIES:
            runs[f"{name}-d{density}"] = ["--density", density, *SWEEP_POLICIES[name]]
            seeds[f"{name}-d{density}"] = [0, 1, 2] if name in CIFAR_LENET_THREE_SEEDS else [0]
    return runs, seeds


SCALECOM_MEMORY = ["--memory", "scalecom"]  # ScaleCom's filtered memory, its default beta


def _scalecom_runs() -> dict[str, list[str]]:
    """Issue 19: ScaleCom (cltk + its low-pass-filtered memory) against cltk alone, top-k, and
    core / vote with and without that memory, at density 1% and 0.1%."""
    runs = {}
    for density in ("0.01", "0.001"):
        d = ["--density", density]
        runs.update({
            f"topk-d{density}": [*d, *SWEEP_POLICIES["topk"]],
            f"cltk-d{density}": [*d, *SWEEP_POLICIES["cltk"]],
            f"scalecom-d{density}": [*d, *SWEEP_POLICIES["cltk"], *SCALECOM_MEMORY],
            f"core-d{density}": [*d, *SWEEP_POLICIES["core"]],
            f"vote-d{density}": [*d, *SWEEP_POLICIES["vote"]],
            f"core-scalecom-d{density}": [*d, *SWEEP_POLICIES["core"], *SCALECOM_MEMORY],
            f"vote-scalecom-d{density}": [*d, *SWEEP_POLICIES["vote"], *SCALECOM_MEMORY],
        })
    return runs


# name -> launcher arguments (added to the sweep's base arguments)
SWEEPS: dict[str, dict] = {
    # issue 6: the thesis-style convergence sweep, CPU-sized (about 80 s per run here)
    "lenet-mnist": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--epochs", "5",
                 "--eval-every", "117"],
        "runs": _lenet_mnist_runs(),
    },
    # issue 6: the same LeNet runs on an emulated 100 Mbit/s link at the server (the thesis's
    # question: does a smaller broadcast make training reach an accuracy sooner in time?)
    "time-to-accuracy": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--epochs", "5",
                 "--eval-every", "117", "--bandwidth", "100Mbit"],
        "runs": {
            "dense": ["--density", "1"],
            "topk-d0.01": ["--density", "0.01", *SWEEP_POLICIES["topk"]],
            "topk-d0.01-limit2k": ["--density", "0.01", "--server-limit", "2k",
                                   *SWEEP_POLICIES["topk"]],
            "core-d0.01": ["--density", "0.01", *SWEEP_POLICIES["core"]],
            "vote-d0.01": ["--density", "0.01", *SWEEP_POLICIES["vote"]],
            "cltk-d0.01": ["--density", "0.01", *SWEEP_POLICIES["cltk"]],
        },
    },
    # the same question on a slower link, where communication outweighs compute even with 8
    # workers sharing 2 cores (dense is left out: ~1.6 s per iteration, see psparse-model)
    "time-to-accuracy-20mbit": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--epochs", "5",
                 "--eval-every", "117", "--bandwidth", "20Mbit"],
        "runs": {
            "topk-d0.01": ["--density", "0.01", *SWEEP_POLICIES["topk"]],
            "topk-d0.01-limit2k": ["--density", "0.01", "--server-limit", "2k",
                                   *SWEEP_POLICIES["topk"]],
            "core-d0.01": ["--density", "0.01", *SWEEP_POLICIES["core"]],
            "vote-d0.01": ["--density", "0.01", *SWEEP_POLICIES["vote"]],
        },
    },
    # issue 6, CPU-sized: ResNet-20/CIFAR-10 for 2 epochs (about 12 min per run on 2 cores),
    # DGC warm-up over the first epoch, SGD lr 0.1, momentum 0.9, weight decay 1e-4.
    "resnet20-cifar10": {
        "base": RESNET20 + ["--epochs", "2", "--eval-every", "98", "--density-warmup", "1"],
        "runs": _resnet20_runs(),
        "target": 0.5,
    },
    # the same sweep sized for a GPU cluster, as in the ResNet paper (He et al. 2016): 128
    # images per iteration (8 x 16), lr 0.1 divided by 10 at epochs 80 and 120, 160 epochs;
    # DGC's 4 warm-up epochs. python -m experiments.run resnet20-cifar10-gpu --data-dir DIR
    "resnet20-cifar10-gpu": {
        "base": ["--workers", "8", "--model", "resnet20", "--dataset", "cifar10",
                 "--batch-size", "16", "--lr", "0.1", "--lr-steps", "80,120", "--momentum",
                 "0.9", "--weight-decay", "1e-4", "--epochs", "160", "--eval-every", "391",
                 "--density-warmup", "4", "--device", "cuda"],
        "runs": _resnet20_runs(),
        "target": 0.9,
    },
    # issue 16, item 2: ResNet-20/CIFAR-10 at length on CPU, run in the background across
    # sessions: dense, top-k and core at 1%, 30 epochs (5,850 iterations of 8 x 32 images), lr
    # 0.1 x 0.1 at epochs 20 and 27, DGC warm-up over epoch 1, the whole test set every epoch
    # and a checkpoint every epoch (a stopped sweep resumes from its last whole epoch). About
    # 6 min per epoch on the idle 2-core machine (resnet20-cifar10's 2 epochs took ~12 min), so
    # ~3 h per run, ~9 h for the three.
    "resnet20-cifar10-long": {
        "base": RESNET20 + ["--epochs", "30", "--lr-steps", "20,27", "--eval-every", "195",
                            "--checkpoint-every", "195", "--density-warmup", "1"],
        "runs": {name: args for name, args in _resnet20_runs().items()
                 if name in ("dense", "topk-d0.01", "core-d0.01")},
        "target": 0.8,
        "progress": True,
    },
    # issue 16: CIFAR-10 trained to convergence on CPU with the thesis era's small CNN, LeNet-5
    # for 3x32x32 input (62,006 parameters; k = 620 at 1%, 62 at 0.1%). 8 workers x 32 images
    # (195 iterations per epoch) with crop-and-flip augmentation; SGD lr 0.05, momentum 0.9,
    # weight decay 5e-4; 30 epochs (5,850 iterations), step schedule: lr x0.1 at epochs 20 and
    # 27; the whole test set evaluated every epoch; a checkpoint every epoch, so a sweep that
    # is stopped resumes the run it stopped in from its last whole epoch (run_one). Seeds 0, 1,
    # 2 for dense, top-k, core, vote and ema, seed 0 for the rest: 33 runs. Time, measured:
    # 5-7 min per run on the idle 2-core machine (estimated beforehand at ~10), ~3.5 h.
    "cifar-lenet": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "cifar10", "--batch-size",
                 "32", "--lr", "0.05", "--lr-steps", "20,27", "--momentum", "0.9",
                 "--weight-decay", "5e-4", "--epochs", "30", "--eval-every", "195",
                 "--checkpoint-every", "195"],
        "runs": _cifar_lenet_runs()[0],
        "seeds": _cifar_lenet_runs()[1],
        "target": 0.6,
        "progress": True,  # ~10 min per run: show the launcher's progress line
    },
    # issue 16, item 3 on CIFAR-10: the trade-off between union/k and accuracy at density 0.1%
    # (k = 62 of LeNet-5's 62,006), with cifar-lenet's settings. vote's union is keep x k
    # exactly, so keep = 2 is the bound; core with a 4x larger own slice (union/k 4.1 on
    # MNIST) between it and top-k (7.4); and vote at twice the density, about top-k's bytes.
    # cifar-lenet has keep = 1.5 and top-k at 0.1%, on 3 seeds.
    "cifar-lenet-low": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "cifar10", "--batch-size",
                 "32", "--lr", "0.05", "--lr-steps", "20,27", "--momentum", "0.9",
                 "--weight-decay", "5e-4", "--epochs", "30", "--eval-every", "195",
                 "--checkpoint-every", "195", "--density", "0.001"],
        "runs": {
            "vote-keep2-d0.001": ["--policy", "vote", "--policy-arg", "keep=2"],
            "vote-keep3-d0.001": ["--policy", "vote", "--policy-arg", "keep=3"],
            "core-own0.5-d0.001": ["--policy", "core", "--policy-arg", "own=0.5"],
            # about top-k's bytes at 0.1% (vote at 0.1% moves 0.38% of a dense allreduce's,
            # top-k 0.69%): is an aligned selection better per byte?
            "vote-d0.002": ["--density", "0.002", "--policy", "vote", "--policy-arg",
                            "keep=1.5"],
        },
        # keep = 2 came within top-k's seed spread on seed 0: seeds 1 and 2 to tell
        "seeds": {"vote-keep2-d0.001": [0, 1, 2]},
        "target": 0.5,
        "progress": True,
    },
    # issue 6 / thesis section 6.2: are large gradient entries few, and do they recur on the
    # same indices over short periods? One epoch of top-k, every worker recording its top-k.
    "locality": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--epochs", "1",
                 "--eval-every", "0", "--record-selections"],
        "runs": {"topk-d0.01": ["--density", "0.01", "--policy", "topk"]},
    },
    # time per iteration at emulated link rates, to check psparse-model (experiments/model_check)
    "cost-model": {
        "base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist", "--density", "0.01",
                 "--iterations", "300", "--eval-every", "0"],
        "runs": {
            f"{policy}{'-' + rate if rate else ''}": ["--policy", policy] + (
                ["--bandwidth", rate] if rate else [])
            for policy in ("topk", "core") for rate in ("", "100Mbit", "1Gbit", "30Mbit")
        },
    },
    "policies": {
        "base": LENET,
        "runs": {
            **{name: SWEEP_POLICIES[name]
               for name in ("topk", "randomk", "threshold", "frequency", "ema")},
            "penalty-0.25": ["--policy", "penalty", "--policy-arg", "pi=0.25"],
            "penalty-0.1": SWEEP_POLICIES["penalty"],
            "cltk": SWEEP_POLICIES["cltk"],
            "core": SWEEP_POLICIES["core"],
            "core-own0.0625": ["--policy", "core", "--policy-arg", "own=0.0625"],
            "core-own0.25": ["--policy", "core", "--policy-arg", "own=0.25"],
            "core-signed": ["--policy", "core", "--policy-arg", "signed=true"],
            "vote": ["--policy", "vote"],
            "vote-keep2": ["--policy", "vote", "--policy-arg", "keep=2"],
            "vote-keep1.5": ["--policy", "vote", "--policy-arg", "keep=1.5"],
        },
    },
    # issue 19: ScaleCom's filtered memory, on the base of "policies" (LeNet/MNIST, 8 workers,
    # 2 epochs); seeds on the command line: python -m experiments.run scalecom --seeds 0,1,2
    "scalecom": {"base": LENET, "runs": _scalecom_runs()},
}


# Exit codes of a launcher that was stopped rather than one whose run failed: interrupted
# (130: SIGINT or SIGTERM), or killed by a signal (negative).
INTERRUPTED = 130


def sent_per_iteration(metrics: list[dict]) -> float:
    """Mean bytes on the wire per iteration, all processes: pushes plus broadcast, or a
    baseline's ring traffic."""
    return float(np.mean([m["allreduce_bytes"] if "allreduce_bytes" in m
                          else m["upload_bytes"] + m["broadcast_bytes"] for m in metrics]))


def union_over_k(metrics: list[dict]) -> np.ndarray:
    """union / k per round (k: the round's budget)."""
    return np.array([m["union"] / m.get("budget", max(m["k"])) for m in metrics])


def epochs_to_near_best(evals: list[dict], within: float = 0.01):
    """The epoch of the first evaluation within ``within`` (accuracy, 0.01 = 1 point) of the
    run's best: how long the run took to get about as far as it got (under a step schedule,
    mostly where the first step falls)."""
    best = max(e["test_acc"] for e in evals)
    return next(e.get("epoch") for e in evals if e["test_acc"] >= best - within)


# exit statuses of a run stopped (by a time limit, or a session that ended) rather than failed
STOPPED = (INTERRUPTED, -signal.SIGKILL, -signal.SIGINT, -signal.SIGTERM)


def exit_status(run_dir: Path) -> int | None:
    """A run's exit status as its summary tells it: 0 (finished), 130 (stopped by a signal),
    1 (failed), or None (no summary: still running, or killed before writing one)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return 0 if summary.get("status") == "ok" else \
        INTERRUPTED if "signal" in str(summary.get("error")) else 1


def reached(run_dir: Path, name: str, seed: int, exit_code: int | None) -> dict:
    """How far one run got, from its run directory, whether it finished or not: epochs and
    iterations reached, the last and best test accuracy of its evaluations, union/k and bytes
    per iteration over a dense ring allreduce's (as the sweep table), training iterations per
    second. What was reached, not a projection."""
    row = {"run": name, "seed": seed, "exit": exit_code, "dir": run_dir.name}
    # complete lines only: a running run may be part-way through writing one
    metrics, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    config = json.loads((run_dir / "config.json").read_text()) \
        if (run_dir / "config.json").is_file() else {}
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").is_file() else None
    row["finished"] = summary is not None and exit_code == 0
    row["code"] = config.get("provenance", {}).get("code_id")
    if not metrics:
        row["failed"] = "no iteration recorded (see the launcher log)"
        return row
    summary = summary or {}
    # the model's size: the summary's (written also by a stopped run's server), else from k
    # (a DDP baseline's rounds have no k: its ring traffic is the allreduce, 100%)
    numel = summary.get("numel") or (round(np.mean(metrics[-1]["k"]) / config["density"])
                                     if "k" in metrics[-1] else None)
    workers = metrics[0]["workers"]
    row["iterations"] = len(metrics)
    row["epochs"] = round(evals[-1]["epoch"], 2) if evals else None
    row["test_acc"] = evals[-1]["test_acc"] if evals else None
    row["best_acc"] = max(e["test_acc"] for e in evals) if evals else None
    row["curve"] = [[e["epoch"], round(e["test_acc"], 4)] for e in evals]
    train_s = metrics[-1]["time_s"]
    row["iterations_per_s"] = round(len(metrics) / train_s, 2) if train_s else None
    row["sent_bytes_per_iteration"] = sent_per_iteration(metrics)
    row["sent_over_allreduce"] = row["sent_bytes_per_iteration"] / \
        dense_allreduce_bytes(workers, numel) if numel else 1.0
    if config.get("density", 1) < 1:  # as the sweep table: every round, warm-up included
        row["union_k_mean"] = float(union_over_k(metrics).mean())
    return row


def ended(row: dict) -> str:
    """finished, stopped (a signal: a time limit, or the session ended), failed (exit status),
    or no summary yet (running, or killed before it could write one)."""
    if row["finished"]:
        return "finished"
    if row["exit"] is None:
        return "no summary (running, or killed)"
    return "stopped" if row["exit"] in STOPPED else f"failed (exit {row['exit']})"


def reached_table(rows: list[dict]) -> str:
    """A markdown table of ``reached`` rows."""
    lines = ["| run | seed | ended | epochs (last evaluation) | iterations | test acc % | best % "
             "| union/k | sent / allreduce % | it/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: "—" if v is None else f"{100 * v:.2f}"  # noqa: E731
    for r in rows:
        union = f"{r['union_k_mean']:.2f}" if "union_k_mean" in r else "—"
        lines.append(f"| {r['run']} | {r['seed']} | {ended(r)}"
                     f" | {r.get('epochs')} | {r.get('iterations')} | {pct(r.get('test_acc'))} "
                     f"| {pct(r.get('best_acc'))} | {union} | "
                     f"{pct(r.get('sent_over_allreduce'))} | {r.get('iterations_per_s')} |")
    return "\n".join(lines)


def run_paths(sweep: str, name: str, args: list[str], seed: int, data_dir: str | None):
    """(run directory, psparse-launch command, identity) of one run of a sweep. The run's
    identity is its arguments, not where the checkout lives (sweeps are often run from a
    separate worktree so that editing the code does not change a running sweep)."""
    out = ROOT / "runs" / sweep / f"{name}-s{seed}"
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet", *args,
           "--seed", str(seed)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    return out, cmd, cmd[6:]


def finished(out: Path, identity: list[str]) -> bool:
    """Whether the run in ``out`` was finished with these arguments (summary.json, and
    command.json equal to them)."""
    command = out / "command.json"
    return (out / "summary.json").is_file() and command.is_file() and \
        json.loads(command.read_text()) == identity


def run_one(sweep: str, name: str, args: list[str], seed: int, data_dir: str | None,
            target: float, progress: bool = False, label: str = "") -> dict:
    """One run of a sweep: reused when finished, resumed from its newest checkpoint when it
    was stopped part-way, else started; its row of figures.

    A run's directory holds ``started.json`` (its arguments, written before the launcher
    starts) and ``command.json`` (the same, written once the launcher has finished, whether the
    run succeeded or failed). A directory with command.json equal to the run's arguments is a
    finished run and is reused. One with only started.json and a checkpoint that the server
    and every worker saved (``--checkpoint-every``) is continued with ``psparse-launch
    --resume``; without a checkpoint it starts over. A launcher that was interrupted or killed
    stops the sweep (SystemExit) without writing command.json, so the next call resumes it."""
    out, cmd, identity = run_paths(sweep, name, args, seed, data_dir)
    summary_path = out / "summary.json"

    def same(file: str) -> bool:
        path = out / file
        return path.is_file() and json.loads(path.read_text()) == identity

    done = finished(out, identity)
    if not done:
        t = time.perf_counter()
        saved = None
        if same("started.json") and (out / "config.json").is_file():
            config = json.loads((out / "config.json").read_text())
            saved = checkpoint.latest_common(out, config["workers"])
            made_by = config.get("provenance", {}).get("code_id")
            if saved is not None and made_by != provenance()["code_id"]:
                # one run, one code: a table states which code made its runs
                print(f"[{sweep}] {label}{name} seed {seed}: its checkpoint was made by other "
                      f"code ({made_by}); starting over", flush=True)
                saved = None
        if saved is not None:
            print(f"[{sweep}] {label}{name} seed {seed}: resuming at iteration {saved} ...",
                  flush=True)
            launch = [sys.executable, "-m", "psparse.launch", "--resume", str(out)]
            launch += [] if progress else ["--quiet"]
        else:
            print(f"[{sweep}] {label}{name} seed {seed} ...", flush=True)
            launch = [c for c in cmd if c != "--quiet"] if progress else cmd
            out.mkdir(parents=True, exist_ok=True)
            (out / "command.json").unlink(missing_ok=True)
            (out / "started.json").write_text(json.dumps(identity))
        r = subprocess.run(launch, cwd=ROOT)
        if r.returncode == INTERRUPTED or r.returncode < 0:
            raise SystemExit(f"[{sweep}] {name} seed {seed} stopped (exit {r.returncode}); run "
                             "the same command again to resume it from its last checkpoint")
        out.mkdir(parents=True, exist_ok=True)  # a launcher that failed early may not have
        (out / "command.json").write_text(json.dumps(identity))
        if r.returncode != 0:
            print(f"[{sweep}] {name} seed {seed} FAILED (exit {r.returncode}); logs in {out}",
                  flush=True)
        print(f"[{sweep}] {label}{name} seed {seed} done in {time.perf_counter() - t:.0f} s",
              flush=True)
    if not summary_path.is_file():
        return {"run": name, "seed": seed, "failed": "no summary (see logs)",
                "dir": str(out.relative_to(ROOT))}
    summary = json.loads(summary_path.read_text())
    if summary["status"] != "ok":
        return {"run": name, "seed": seed, "failed": summary["error"],
                "dir": str(out.relative_to(ROOT))}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    workers, numel = summary["world_size"], summary["numel"]
    row = {"run": name, "seed": seed, "test_acc": summary["test_acc"],
           "best_acc": max(e["test_acc"] for e in evals),
           "epochs_to_near_best": epochs_to_near_best(evals),
           "broadcast_mb": summary["broadcast_mb"], "upload_mb": summary["upload_mb"],
           "iterations_per_s": summary["iterations_per_s"],
           "ms_per_iteration": 1000 * summary["wall_s"] / summary["iterations"],
           "target_acc": target,
           # wall time at the first evaluation that reached the target (None: never reached)
           "time_to_target_s": next((e["time_s"] for e in evals if e["test_acc"] >= target),
                                    None),
           "iterations": summary["iterations"], "workers": workers, "numel": numel,
           # bytes on the wire per iteration, all processes together: the workers' pushes
           # (two-phase policies' proposals included) and the server's broadcast (vote's and
           # cltk's index broadcast included), or a baseline's ring traffic; over what a dense
           # ring allreduce of the same model sends (ALLREDUCE_DEFINITION)
           "sent_bytes_per_iteration": sent_per_iteration(metrics),
           "allreduce_bytes_per_iteration": dense_allreduce_bytes(workers, numel),
           # which code made the run (config.json; None for runs made before it was recorded)
           "code": json.loads((out / "config.json").read_text()).get(
               "provenance", {}).get("code_id") if (out / "config.json").is_file() else None,
           "dir": str(out.relative_to(ROOT))}
    row["sent_over_allreduce"] = row["sent_bytes_per_iteration"] / \
        row["allreduce_bytes_per_iteration"]
    if "baseline" in summary:  # DDP: dense ring allreduce, no union; bytes = ring traffic
        row.update(baseline=summary["baseline"], union_k_mean=1.0, union_k_p95=1.0,
                   k_mean=float(summary["numel"]))
        return row
    ratio = union_over_k(metrics)
    row.update(union_k_mean=float(ratio.mean()), union_k_p95=float(np.percentile(ratio, 95)),
               k_mean=float(np.mean([np.mean(m["k"]) for m in metrics])))
    return row


ALLREDUCE_DEFINITION = (
    "up + bcast, % of allreduce: the bytes all workers push (proposals included) plus the "
    "bytes the server broadcasts (index broadcasts included), per iteration, as a share of the "
    "bytes a dense ring allreduce of the same model sends per iteration, all workers together: "
    "N workers x 2(N-1)/N x numel x 4 B (reduce-scatter and all-gather, float32; the same "
    "count as the DDP baseline's allreduce_bytes, so DDP is 100%). psparse's counts include "
    "message headers, the ring's do not; dense exchange through the server is 2N/(2(N-1)) = "
    "114% at N = 8.")


def dense_allreduce_bytes(workers: int, numel: int) -> float:
    """Bytes a dense float32 ring allreduce sends per iteration, all workers together:
    each of N workers sends 2(N-1)/N x numel x 4 B (reduce-scatter, then all-gather)."""
    return workers * 2 * (workers - 1) / workers * numel * 4


def table(rows: list[dict]) -> str:
    """The sweep's table: one line per run, means over its seeds; "±" is the sample standard
    deviation over seeds (ddof=1); the definition of the bytes ratio below it."""
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        by_run.setdefault(r["run"], []).append(r)
    target = next((r["target_acc"] for r in rows if "target_acc" in r), 0.98)
    lines = ["| run | seeds | final acc % (± sample SD) | best acc % | union/k mean | "
             "union/k p95 | broadcast MB | upload MB | up + bcast, % of allreduce | mean k | "
             f"ms/iter | s to {100 * target:g}% | epochs to within 1 pt of best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in by_run.items():
        failed = [r for r in rs if "failed" in r]
        if failed:
            lines.append(f"| {name} | {len(rs)} | failed: {failed[0]['failed'][:90]} | | | | | "
                         "| | | | | |")
            continue
        acc = np.array([r["test_acc"] for r in rs]) * 100
        accs = f"{acc.mean():.2f}" + (f" ± {acc.std(ddof=1):.2f}" if len(rs) > 1 else "")
        mean = lambda key: np.mean([r[key] for r in rs])  # noqa: E731
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        to_target = (f"{np.mean(reached):.0f}" if len(reached) == len(rs) else
                     f"not reached ({len(rs) - len(reached)} of {len(rs)})")
        # rows made before these columns existed do not have them
        epochs = [r.get("epochs_to_near_best") for r in rs]
        near_best = f"{np.mean(epochs):.1f}" if None not in epochs else "—"
        ratio = f"{100 * mean('sent_over_allreduce'):.2f}" \
            if all("sent_over_allreduce" in r for r in rs) else "—"
        lines.append(f"| {name} | {len(rs)} | {accs} | {100 * mean('best_acc'):.2f} | "
                     f"{mean('union_k_mean'):.2f} | {mean('union_k_p95'):.2f} | "
                     f"{mean('broadcast_mb'):.1f} | {mean('upload_mb'):.1f} | {ratio} | "
                     f"{mean('k_mean'):.0f} | {mean('ms_per_iteration'):.1f} | {to_target} | "
                     f"{near_best} |")
    return "\n".join(lines) + "\n\n" + ALLREDUCE_DEFINITION + "\n\n" + made_by(rows)


def made_by(rows: list[dict]) -> str:
    """Which code made a table's runs (config.json's provenance), one line."""
    codes: dict[str, list[str]] = {}
    for r in rows:
        codes.setdefault(r.get("code") or "not recorded", []).append(f"{r['run']}-s{r['seed']}")
    if len(codes) == 1:
        return f"Made by one code version: {next(iter(codes))}."
    return (f"Made by {len(codes)} code versions: " +
            "; ".join(f"{code} ({', '.join(runs)})" for code, runs in codes.items()) + ".")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", choices=sorted(SWEEPS))
    p.add_argument("--only", default=None, help="comma-separated run names of the sweep")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds for every run (default: the sweep's seeds per "
                        "run, else 0)")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    p.add_argument("--stem", default=None,
                   help="name of the results files (default: the sweep, plus the --only runs)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the psparse-launch arguments of every run and stop")
    p.add_argument("--report", action="store_true",
                   help="start no run: the table and figures of the runs already finished "
                        "(while the sweep goes on elsewhere), naming those that are not, and "
                        "how far each started one got (epochs, last and best accuracy; also in "
                        "STEM-unfinished.json)")
    args = p.parse_args(argv)
    sweep = SWEEPS[args.sweep]
    names = args.only.split(",") if args.only else list(sweep["runs"])
    unknown = [n for n in names if n not in sweep["runs"]]
    if unknown:
        p.error(f"unknown run(s) {unknown}; the sweep has {list(sweep['runs'])}")
    if args.seeds is not None:
        seeds = {name: [int(s) for s in args.seeds.split(",")] for name in names}
    else:
        seeds = {name: sweep.get("seeds", {}).get(name, [0]) for name in names}
    # seed-major, as before: every run's seed 0 first, so a stopped sweep has one of each
    plan = [(name, seed) for seed in sorted({s for v in seeds.values() for s in v})
            for name in names if seed in seeds[name]]
    if args.dry_run:
        for name in names:
            print(f"{name} (seeds {','.join(map(str, seeds[name]))}): psparse-launch "
                  f"{' '.join(sweep['base'] + sweep['runs'][name])}")
        return 0
    unfinished = []  # --report: how far the runs not finished yet got
    pending = []  # --report: the runs not finished yet
    if args.report:
        for name, seed in plan:
            out, _, identity = run_paths(args.sweep, name, sweep["base"] + sweep["runs"][name],
                                         seed, args.data_dir)
            if finished(out, identity):
                continue
            pending.append(f"{name}-s{seed}")
            started = out / "started.json"  # this run's, not one made with other arguments
            if (out / "metrics.jsonl").is_file() and started.is_file() and \
                    json.loads(started.read_text()) == identity:
                unfinished.append(reached(out, name, seed, exit_status(out)))
                # a summary without command.json: the launcher did not end (killed after it)
                unfinished[-1]["finished"] = False
        plan = [(name, seed) for name, seed in plan if f"{name}-s{seed}" not in pending]
        if not plan and not unfinished:
            print(f"[{args.sweep}] no run is finished or started yet")
            return 1
    rows = []
    for i, (name, seed) in enumerate(plan):
        rows.append(run_one(args.sweep, name, sweep["base"] + sweep["runs"][name], seed,
                            args.data_dir, sweep.get("target", 0.98),
                            progress=sweep.get("progress", False),
                            label=f"{i + 1}/{len(plan)} "))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.stem or (args.sweep if not args.only else f"{args.sweep}-{'-'.join(names)}")
    if args.report and pending and not args.stem:
        stem += "-partial"  # never over the finished sweep's own table
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    text = table(rows) if rows else "No run is finished yet."
    if args.report and pending:
        text += f"\n\nNot finished yet ({len(pending)}): {', '.join(pending)}."
    (RESULTS / f"{stem}-unfinished.json").unlink(missing_ok=True)  # never a stale one
    if unfinished:
        (RESULTS / f"{stem}-unfinished.json").write_text(json.dumps(unfinished, indent=1))
        text += ("\n\nHow far the unfinished runs got (their last evaluation; what was reached, "
                 "not a projection):\n\n" + reached_table(unfinished) + "\n\n" +
                 made_by(unfinished))
    (RESULTS / f"{stem}.md").write_text(text + "\n")
    if not pending and stem == args.sweep:
        # the whole sweep's table now stands: an earlier --report's snapshot would contradict it
        for stale in RESULTS.glob(f"{stem}-partial*"):
            stale.unlink()
    print(text)
    if not rows:
        return 0
    for path in figures.build(args.sweep, stem, rows):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
