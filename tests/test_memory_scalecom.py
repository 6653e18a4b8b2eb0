"""ScaleCom's low-pass-filtered error-feedback memory (``--memory scalecom``,
psparse/policies/memory.py).

The update, per worker and round, with s_t = p_t at the sent indices (zero elsewhere):
p_t = m_t + g_t (selected from), m_{t+1} = (1 - beta) m_t + beta (p_t - s_t).
"""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
from conftest import read_jsonl, run_launch

from psparse.backends.cuda import CudaBackend
from psparse.backends.emulated import EmulatedBackend
from psparse.config import ConfigError, RunConfig
from psparse.ops.select import selection
from psparse.policies.memory import SCALECOM_BETA, Memory
from psparse.xp import cupy_or_none

cupy = cupy_or_none()


def f32(*values):
    return np.array(values, dtype=np.float32)


def test_filter_follows_a_hand_computed_sequence():
    """beta = 0.5, three entries, top-1 sent each round; every number worked out by hand
    (all are exact in float32, so the checks are equalities)."""
    m = Memory(3, "scalecom", beta=0.5)
    # round 1: m = 0, g = (4, 1, -2): p = (4, 1, -2); entry 0 sent (4)
    #   r = (0, 1, -2); m = 0.5 * 0 + 0.5 * r = (0, 0.5, -1)
    assert m.add(f32(4, 1, -2)).tolist() == [4, 1, -2]
    assert m.take(np.array([0])).tolist() == [4]
    assert m.filtered.tolist() == [0, 0.5, -1]
    # round 2: g = (1, 2, 1): p = (1, 2.5, 0); entry 1 sent (2.5)
    #   r = (1, 0, 0); m = 0.5 * (0, 0.5, -1) + 0.5 * (1, 0, 0) = (0.5, 0.25, -0.5)
    #   the sent entry keeps (1 - beta) of its old memory: 0.5 * 0.5 = 0.25
    assert m.add(f32(1, 2, 1)).tolist() == [1, 2.5, 0]
    assert m.take(np.array([1])).tolist() == [2.5]
    assert m.filtered.tolist() == [0.5, 0.25, -0.5]
    # round 3: g = (-1, 0, -3): p = (-0.5, 0.25, -3.5); entry 2 sent (-3.5)
    #   r = (-0.5, 0.25, 0); m = 0.5 * (0.5, 0.25, -0.5) + 0.5 * r = (0, 0.25, -0.25)
    assert m.add(f32(-1, 0, -3)).tolist() == [-0.5, 0.25, -3.5]
    assert m.take(np.array([2])).tolist() == [-3.5]
    assert m.filtered.tolist() == [0, 0.25, -0.25]
    # conservation, by hand: computed (4, 3, -4) = sent (4, 2.5, -3.5) + m / beta (0, 0.5, -0.5)
    assert m.optimizer_momentum_applies  # the optimizer's momentum applies, as with residual


def test_beta_one_is_plain_error_feedback_bit_for_bit():
    rng = np.random.default_rng(0)
    plain, filtered = Memory(500, "residual"), Memory(500, "scalecom", beta=1.0)
    for _ in range(20):
        g = rng.standard_normal(500).astype(np.float32)
        a, b = plain.add(g), filtered.add(g)
        np.testing.assert_array_equal(a, b)
        idx = selection.topk_reference(a, 25)
        np.testing.assert_array_equal(plain.take(idx), filtered.take(idx))
        np.testing.assert_array_equal(plain.accumulator, filtered.filtered)


def _run(memory: Memory, grads, k: int):
    """Rounds of add / top-k / take; returns (sum of gradients, sum of what was sent), float64."""
    computed = np.zeros(memory.accumulator.size)
    sent = np.zeros(memory.accumulator.size)
    for g in grads:
        acc = memory.add(g)
        idx = selection.topk_reference(acc, k)
        sent[idx] += memory.take(idx)
        computed += g
    return computed, sent


@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0])
def test_computed_equals_sent_plus_memory_over_beta_exactly(beta):
    """Small integer gradients and a power-of-two beta keep every value exact in float32: the
    conservation law holds as an equality. The filter's difference to plain error feedback's
    "sent + memory" is exactly (1/beta - 1) * memory: still to be sent, not lost."""
    rng = np.random.default_rng(1)
    m = Memory(6, "scalecom", beta=beta)
    grads = [rng.integers(-4, 5, 6).astype(np.float32) for _ in range(8)]
    computed, sent = _run(m, grads, 2)
    memory = m.filtered.astype(np.float64)
    assert memory.any() and sent.any()
    np.testing.assert_array_equal(computed, sent + memory / beta)
    np.testing.assert_array_equal(computed - (sent + memory), (1 / beta - 1) * memory)


@pytest.mark.parametrize("beta", [SCALECOM_BETA, 0.3])
def test_conservation_over_many_rounds_of_float_gradients(beta):
    rng = np.random.default_rng(2)
    m = Memory(2000, "scalecom", beta=beta)
    grads = [rng.standard_normal(2000).astype(np.float32) for _ in range(60)]
    computed, sent = _run(m, grads, 20)
    residual = computed - (sent + m.filtered / beta)
    assert np.abs(residual).max() < 1e-4 * np.abs(computed).max()
    # what plain error feedback would call lost is the filter's backlog, (1/beta - 1) * m
    backlog = computed - (sent + m.filtered)
    np.testing.assert_allclose(backlog, (1 / beta - 1) * m.filtered, atol=1e-3)


def test_clipped_gradients_are_what_the_memory_conserves():
    m = Memory(2, "scalecom", clip_norm=1.0, beta=0.5)
    assert m.add(f32(3, 4)).tolist() == pytest.approx([0.6, 0.8])  # norm 5 -> 1
    assert m.take(np.array([1])).tolist() == pytest.approx([0.8])
    np.testing.assert_allclose(m.filtered, [0.3, 0.0], rtol=1e-6)  # 0.5 * (0.6, 0)


def test_state_dict_carries_the_filtered_memory_and_restores_it():
    """What a checkpoint saves (Session.state_dict: memory.state_dict()) is enough to continue
    exactly as the uninterrupted memory does (Session.load_state_dict assigns by name)."""
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(300).astype(np.float32) for _ in range(10)]
    whole = Memory(300, "scalecom", beta=0.2)
    _run(whole, grads[:5], 15)
    state = {name: np.array(a) for name, a in whole.state_dict().items()}
    assert set(state) == {"filtered"} and state["filtered"].any()
    resumed = Memory(300, "scalecom", beta=0.2)
    for name, array in state.items():
        getattr(resumed, name)[...] = array
    for g in grads[5:]:
        a, b = whole.add(g), resumed.add(g)
        np.testing.assert_array_equal(a, b)
        idx = selection.topk_reference(a, 15)
        np.testing.assert_array_equal(whole.take(idx), resumed.take(idx))
    np.testing.assert_array_equal(whole.filtered, resumed.filtered)


@pytest.mark.parametrize("beta", [0.0, -0.1, 1.5, float("nan")])
def test_a_bad_beta_is_refused(beta):
    with pytest.raises(ValueError, match=r"beta must be in \(0, 1\]"):
        Memory(10, "scalecom", beta=beta)
    with pytest.raises(ConfigError, match=r"memory-beta must be in \(0, 1\]"):
        RunConfig(memory="scalecom", memory_beta=beta).validate()


def test_beta_defaults_for_scalecom_and_is_refused_without_it():
    assert RunConfig(memory="scalecom").validate().memory_beta == SCALECOM_BETA
    assert RunConfig().validate().memory_beta is None
    with pytest.raises(ConfigError, match="memory-beta 0.5 is the scalecom memory's"):
        RunConfig(memory="residual", memory_beta=0.5).validate()


def test_the_launcher_refuses_a_bad_beta_before_starting_anything(tmp_path):
    r = run_launch("--out", str(tmp_path / "run"),
                   "--model", "mlp", "--dataset", "digits", "--memory",
                   "scalecom", "--memory-beta", "2", timeout=120)
    assert r.returncode == 2 and "memory-beta must be in (0, 1]" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_device_scalecom_memory_matches_the_cpu():
    """The GPU path's memory (emulated on the CPU; on CUDA when there is a device)."""
    dev = CudaBackend(cupy) if cupy is not None else EmulatedBackend(strict=True)
    cpu, device = Memory(65_537, "scalecom", beta=0.3), Memory(65_537, "scalecom", beta=0.3,
                                                               dev=dev)
    rng = np.random.default_rng(4)
    for _ in range(4):
        g = rng.standard_normal(65_537).astype(np.float32)
        a = cpu.add(g)
        np.testing.assert_array_equal(dev.read(device.add(dev.upload("gradient", g))), a)
        idx = selection.topk_reference(a, 500)
        np.testing.assert_array_equal(dev.read(device.take(dev.upload("indices", idx))),
                                      cpu.take(idx))
        np.testing.assert_array_equal(dev.read(device.filtered), cpu.filtered)


RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "300",
       "--eval-every", "100", "--policy", "cltk", "--memory", "scalecom", "--checkpoint-every",
       "100", "--seed", "4", "--threads", "1", "--quiet"]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


@pytest.mark.long
def test_cltk_with_the_scalecom_memory_trains_and_resumes_exactly(tmp_path):
    """ScaleCom as the paper pairs it (cyclic local top-k + filtered memory): 3 real worker
    processes and a server train the MLP on digits; the union stays k; a run resumed from its
    checkpoint at iteration 100 ends bit-identical to the uninterrupted one, so checkpoints
    carry the filtered memory (without it the resumed workers would select differently)."""
    whole = tmp_path / "whole"
    r = run_launch("--out", str(whole), *RUN, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["test_acc"] > 0.9, summary["test_acc"]  # chance is 0.1; 97.6% measured
    metrics = read_jsonl(whole / "metrics.jsonl")
    assert len(metrics) == 300 and all(m["union"] == m["budget"] for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    config = json.loads((whole / "config.json").read_text())
    assert config["memory"] == "scalecom" and config["memory_beta"] == SCALECOM_BETA
    assert "memory=scalecom(beta=0.1)" in (whole / "logs" / "rank-0.log").read_text()
    ranks = [json.loads((whole / f"rank-{k}.json").read_text()) for k in range(3)]
    assert len({x["checksum"] for x in ranks}) == 1

    # the state at iteration 100: take the run back there and let --resume finish it
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    for saved in (cut / "checkpoint").glob("*-200.pt"):
        saved.unlink()
    (cut / "summary.json").unlink()  # a run stopped after 100 has no summary saying ok
    with open(cut / "checkpoint" / "rank-1-100.pt", "rb") as fh:
        memory_state = pickle.load(fh)["memory"]
    assert set(memory_state) == {"filtered"} and np.abs(memory_state["filtered"]).max() > 0
    r = run_launch("--resume", str(cut), "--quiet", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at iteration 100" in (cut / "logs" / "server.log").read_text()
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(cut / name)) == \
            without_timing(read_jsonl(whole / name)), name
    for k in range(3):
        assert json.loads((cut / f"rank-{k}.json").read_text())["checksum"] == \
            ranks[k]["checksum"]
