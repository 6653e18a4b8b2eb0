"""The built-in loop's --amp, --channels-last and learning-rate schedule (--lr-schedule,
--warmup-epochs, --nesterov), in real launcher runs (psparse and the DDP baseline) and as
numbers (psparse.training.schedule)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from conftest import read_jsonl, run_launch

from psparse.config import ConfigError, RunConfig
from psparse.training.loop import EMULATED_BF16, native_bf16
from psparse.training.schedule import learning_rate, varies

LENET = ["--workers", "2", "--model", "lenet", "--dataset", "mnist", "--iterations", "40",
         "--lr", "0.1", "--density", "0.1", "--eval-every", "20", "--eval-samples", "200",
         "--threads", "1"]


def launch(out, *args, timeout=300):
    r = run_launch("--quiet", "--out", str(out), *args, timeout=timeout, env={**os.environ})
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok", summary["error"]
    return [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]


def test_warmup_then_cosine_and_the_step_schedule_as_numbers():
    cfg = RunConfig(lr=0.2, lr_schedule="cosine", warmup_epochs=2).validate()
    # 10 batches an epoch, 100 iterations: 20 of warm-up, then cosine over 80
    assert [learning_rate(cfg, it, 10, 100) for it in (0, 9, 19)] == pytest.approx([0.01, 0.1, 0.2])
    assert learning_rate(cfg, 20, 10, 100) == pytest.approx(0.2)
    assert learning_rate(cfg, 60, 10, 100) == pytest.approx(0.1)  # half-way: (1 + cos(pi/2)) / 2
    assert learning_rate(cfg, 99, 10, 100) == pytest.approx(0.1 * (1 + math.cos(math.pi * 79 / 80)))
    assert all(a > b for a, b in zip(*[[learning_rate(cfg, it, 10, 100) for it in range(s, 100)]
                                       for s in (20, 21)]))
    step = RunConfig(lr=0.1, lr_steps="2,3", warmup_epochs=1).validate()
    assert learning_rate(step, 4, 10, 100) == pytest.approx(0.05)  # warm-up first
    assert [learning_rate(step, it, 10, 100) for it in (10, 19, 20, 30)] == \
        pytest.approx([0.1, 0.1, 0.01, 0.001])
    assert not varies(RunConfig().validate())
    for bad, match in ((dict(amp="fp8"), "amp must be bf16 or fp16"),
                       (dict(nesterov=True, momentum=0.0), "nesterov needs momentum"),
                       (dict(lr_schedule="linear"), "lr-schedule must be one of"),
                       (dict(lr_schedule="cosine", lr_steps="2"), "lr-steps are for"),
                       (dict(warmup_epochs=-1.0), "warmup-epochs must be >= 0")):
        with pytest.raises(ConfigError, match=match):
            RunConfig(**bad).validate()


@pytest.mark.long
def test_the_schedule_flags_change_a_real_run_where_they_should(tmp_path):
    """digits, 2 workers, dense (23 batches an epoch): a warm-up changes the very first step
    (iteration 1's loss), Nesterov too; a cosine schedule without warm-up starts at --lr, so
    iteration 1 matches the constant run and later ones do not."""
    base = ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations", "30",
            "--eval-every", "0", "--density", "1", "--lr", "0.5"]
    const = launch(tmp_path / "const", *base)
    warm = launch(tmp_path / "warm", *base, "--warmup-epochs", "0.5")
    cosine = launch(tmp_path / "cosine", *base, "--lr-schedule", "cosine")
    nesterov = launch(tmp_path / "nesterov", *base, "--nesterov")
    assert const[0] == warm[0] == cosine[0] == nesterov[0]  # the loss before any step
    assert warm[1] != const[1] and nesterov[1] != const[1]
    assert cosine[1] == const[1] and cosine[-1] != const[-1]


@pytest.mark.parametrize("baseline", [pytest.param(None, marks=pytest.mark.long), pytest.param("ddp", marks=pytest.mark.long)])
def test_bf16_channels_last_trains_and_fp16_goes_through_the_scaler(tmp_path, baseline):
    """LeNet-5 (convolutions) in the built-in loop and the DDP baseline: bf16 autocast with
    channels-last batches trains as float32 does (every rank's checksum equal: the run ends ok),
    with floats that are not float32's; fp16 autocast goes through a GradScaler (scale 2^16) whose scaled
    gradients never reach the exchange or the step still scaled: its losses follow float32's
    within fp16's rounding, where a step on the scaled gradient (2^16 times too far) would
    blow the loss up."""
    extra = ["--baseline", baseline] if baseline else []
    fp32 = launch(tmp_path / "fp32", *LENET, *extra)
    bf16 = launch(tmp_path / "bf16", *LENET, *extra, "--amp", "bf16", "--channels-last")
    fp16 = launch(tmp_path / "fp16", *LENET, *extra, "--amp", "fp16")
    for losses in (fp32, bf16, fp16):  # each trains: the last 10 well under the first
        assert np.mean(losses[-10:]) < 0.8 * losses[0], losses
    # ... on float32's path at first (rounding differences grow chaotically later on)
    assert bf16 != fp32 and np.allclose(bf16[:15], fp32[:15], rtol=2e-2), (bf16, fp32)
    assert np.allclose(fp16[:15], fp32[:15], rtol=2e-2), (fp16, fp32)
    evals = read_jsonl(tmp_path / "bf16" / "eval.jsonl")
    assert evals[-1]["test_acc"] > 0.3  # evaluated with the same autocast: a real accuracy
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["amp"] == "bf16" and config["channels_last"] is True
    # a CPU that emulates bf16 (no AVX512-BF16, no AMX) is told so, once, by rank 0
    said = [(tmp_path / "bf16" / "logs" / f"rank-{r}.log").read_text().count(EMULATED_BF16)
            for r in range(2)]
    assert said == ([0, 0] if native_bf16() else [1, 0]), said


def test_which_cpus_compute_bf16_in_hardware():
    """/proc/cpuinfo's flags, as an AMX Xeon, an AVX512-BF16 EPYC and an AVX2-only EPYC
    print them (shortened)."""
    line = "flags\t\t: fpu vme sse2 avx2 {}\nbogomips\t: 4000\n"
    assert native_bf16(line.format("avx512f avx512_bf16 amx_bf16 amx_tile") * 2)
    assert native_bf16(line.format("avx512f avx512_bf16"))
    assert not native_bf16(line.format("fma"))
    assert native_bf16("processor\t: 0\n")  # no flags to read (another system): no warning


def test_evaluation_on_every_core_equals_one_cores(data_root):
    """The evaluator uses every core while the other ranks wait (loop.eval_threads); its
    results are the ones thread count does not change, so a run evaluated on a one-core host
    (the emulated cluster's) and on this machine agree (experiments/time_to_accuracy.py's
    premise)."""
    import os

    import torch

    from psparse.data import load_dataset
    from psparse.training.loop import evaluate_model
    from psparse.training.models import build_model

    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip(f"one core here ({sorted(cores)}): nothing to compare")
    torch.manual_seed(0)
    data = load_dataset("mnist", data_root)
    model = build_model("lenet", data.in_shape, data.num_classes, {})
    results = []
    try:
        for allowed in ({min(cores)}, cores):
            os.sched_setaffinity(0, allowed)
            results.append(evaluate_model(model, data, torch.device("cpu"), 3000))
    finally:
        os.sched_setaffinity(0, cores)
    assert results[0] == results[1]
