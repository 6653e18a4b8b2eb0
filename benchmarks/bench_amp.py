"""The built-in loop's iteration with --amp and --channels-last, as ratios to float32 (issue 50).

    .venv/bin/python benchmarks/bench_amp.py                  # ResNet-20, 8 workers (~6 min)
    .venv/bin/python benchmarks/bench_amp.py --iterations 40 --modes fp32,bf16-cl

Two measurements, each against a baseline measured in the same run:

1. **One step** (forward, backward, SGD step) of one ResNet-20 replica on a batch of 32, one
   thread, in this process: float32, channels-last, bf16 autocast, bf16 + channels-last
   (the model's parameters are made flat views first, as a psparse worker's are).
2. **A whole psparse iteration**: ``psparse-launch`` with 8 workers on this machine (top-k at
   1%, CIFAR-10), the median of the steady iterations (metrics.jsonl, after 5; no evaluation),
   per mode. Its physical limit on this machine is the compute alone: 8 workers' steps on the
   cores there are, 8 x (1.) / cores.

Then what else an accuracy run spends time on, at the fastest mode: start-up and shutdown (the
launcher's wall time less the training's), against a 30-epoch run, and one evaluation on the
whole test set (10,000 images, rank 0, with the run's autocast) on one core and on every core
(as the loop evaluates: loop.eval_threads), against an epoch's training (195 iterations of
8 x 32 images); and one worker's data, a batch's crop, flip and normalisation, against a step.
Writes ``loop_amp`` to benchmarks/results/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

MODES = {  # name -> the launcher's flags
    "fp32": [],
    "cl": ["--channels-last"],
    "bf16": ["--amp", "bf16"],
    "bf16-cl": ["--amp", "bf16", "--channels-last"],
}
EPOCH = 195  # iterations in an epoch of CIFAR-10 with 8 x 32 images


def step_ms(mode: str, repeats: int = 20) -> float:
    """Median ms of one ResNet-20 step (batch 32, one thread) in ``mode``."""
    import torch
    import torch.nn.functional as F

    from psparse.training.loop import Precision
    from psparse.training.models import build_model
    from psparse.worker.flat_model import FlatModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    flags = MODES[mode]
    amp = flags[flags.index("--amp") + 1] if "--amp" in flags else None
    precision = Precision(amp, "--channels-last" in flags, torch.device("cpu"))
    model = build_model("resnet20", (3, 32, 32), 10, {})
    FlatModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = precision.images(torch.randn(32, 3, 32, 32)), torch.randint(0, 10, (32,))
    times = []
    for i in range(repeats + 3):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with precision.autocast():
            loss = F.cross_entropy(model(x), y)
        precision.backward(loss)
        precision.step(opt)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def launch(out: Path, mode: str, iterations: int, extra: list[str]) -> tuple[float, float]:
    """(median steady iteration ms, seconds of the launch outside training: start-up and
    shutdown, the launcher's wall time less summary.json's wall_s)."""
    cmd = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
           "--workers", "8", "--model", "resnet20", "--dataset", "cifar10", "--density", "0.01",
           "--iterations", str(iterations), "--eval-every", "0", "--eval-samples", "10",
           *MODES[mode], *extra]
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])][5:]
    wall = json.loads((out / "summary.json").read_text())["wall_s"]
    return 1e3 * statistics.median(steps), max(0.0, time.time() - t0 - wall)


def eval_s(mode: str) -> tuple[float, float]:
    """Seconds of one whole-test-set evaluation of ResNet-20 in ``mode``: on one thread
    (evaluate_model given one), and as the loop runs it (every core: loop.eval_threads)."""
    import torch

    from psparse.data import load_dataset
    from psparse.training.loop import Precision, evaluate_model
    from psparse.training.models import build_model

    torch.set_num_threads(1)
    flags = MODES[mode]
    amp = flags[flags.index("--amp") + 1] if "--amp" in flags else None
    precision = Precision(amp, "--channels-last" in flags, torch.device("cpu"))
    data = load_dataset("cifar10", None)
    model = build_model("resnet20", data.in_shape, data.num_classes, {})
    times = []
    for cores in (1, None):
        if cores == 1:  # what the loop did before eval_threads: the worker's one thread
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        else:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        t = time.perf_counter()
        evaluate_model(model, data, torch.device("cpu"), None, precision)
        times.append(time.perf_counter() - t)
    return times[0], times[1]


def batch_ms(repeats: int = 200) -> float:
    """Mean ms of one worker's CIFAR-10 batch of 32 (crop, flip, normalise: Shard.batch)."""
    import torch

    from psparse.data import Shard, load_dataset

    torch.set_num_threads(1)
    shard = Shard(load_dataset("cifar10", None), 0, 8, 32, 0)
    for it in range(5):
        shard.batch(it)
    t = time.perf_counter()
    for it in range(repeats):
        shard.batch(it)
    return 1e3 * (time.perf_counter() - t) / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=60,
                   help="iterations of each 8-worker run (default 60; the first 5 are left out)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, the first is the baseline (default {','.join(MODES)})")
    p.add_argument("--no-record", action="store_true", help="do not write bench.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    cores = os.cpu_count() or 1
    print(f"one ResNet-20 step, batch 32, one thread ({cores} cores here)", flush=True)
    steps = {m: step_ms(m) for m in modes}
    base = modes[0]
    print(table([[m, f"{steps[m]:.1f}", f"{steps[base] / steps[m]:.2f}x"] for m in modes],
                ["mode", "ms", f"speed-up vs {base}"]), flush=True)
    runs, starts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in modes:
            print(f"8-worker psparse run, {m} ...", flush=True)
            runs[m], starts[m] = launch(Path(tmp) / m, m, args.iterations, [])
    best = min(modes, key=lambda m: runs[m])
    limit = {m: 8 * steps[m] / cores for m in modes}
    print(table([[m, f"{runs[m]:.0f}", f"{runs[base] / runs[m]:.2f}x",
                  f"{limit[m]:.0f}", f"{runs[m] / limit[m]:.2f}x"] for m in modes],
                ["mode", "iteration ms (median)", f"speed-up vs {base}",
                 "compute-only limit ms", "over the limit"]))
    one, every = eval_s(best)
    data_ms = batch_ms()
    print(f"\none worker's batch (crop, flip, normalise): {data_ms:.2f} ms, "
          f"{data_ms / steps[best]:.1%} of its step at {best}")
    epoch_s = EPOCH * runs[best] / 1e3
    print(f"\nat {best}: start-up and shutdown {starts[best]:.1f} s once per run, "
          f"{starts[best] / (30 * epoch_s):.1%} of a 30-epoch run's training "
          f"({30 * epoch_s / 60:.0f} min); one whole-test-set evaluation (every epoch; the "
          f"other ranks wait for it) {one:.1f} s on one core, {one / epoch_s:.1%} of an epoch "
          f"({epoch_s:.1f} s), {every:.1f} s on all {cores} ({every / epoch_s:.1%}): the loop's")
    if not args.no_record:
        record({"loop_amp": {
            "step_ms": {m: round(v, 2) for m, v in steps.items()},
            "iteration_ms": {m: round(v, 1) for m, v in runs.items()},
            "compute_limit_ms": {m: round(v, 1) for m, v in limit.items()},
            "speedup_vs_" + base: {m: round(runs[base] / runs[m], 3) for m in modes},
            "startup_s": {m: round(v, 1) for m, v in starts.items()},
            "eval_s_one_core": round(one, 2), "eval_s": round(every, 2), "eval_mode": best,
            "batch_ms": round(data_ms, 3),
            "epoch_train_s": round(epoch_s, 1),
            "iterations": args.iterations}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
