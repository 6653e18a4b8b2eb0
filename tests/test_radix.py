"""The device selection engine (psparse/ops/select/radix.py) against its references, on the CPU.

``plan_reference`` (the plan in array operations) selects exactly ``topk_reference``'s set on
adversarial inputs; the CUDA C kernels, run by the emulator (psparse/backends/kernel_emu.py), follow the
plan step by step (mode, candidates, threshold, ties still needed) and write its selection, for
every key mode, in single and many segments, with the fused accumulation and take. The same
tests run on a CUDA device when there is one.
"""

from __future__ import annotations

import numpy as np
import pytest

from psparse.backends.emulated import EmulatedBackend
from psparse.ops.select import radix, selection
from psparse.ops.select.radix import RadixSelect, keys_reference, plan_reference
from psparse.xp import cupy_or_none

# sizes that are not multiples of the block (256) or the tile (4096)
SIZES = [1, 7, 1000, 4097, 65_537]


def _adversarial(n: int, seed: int):
    """(name, float32 vector) cases that stress the plan: ties, zeros, signs, subnormals."""
    rng = np.random.default_rng(seed)
    heavy = (rng.standard_normal(n) * rng.standard_normal(n) ** 3).astype(np.float32)
    grid = (np.round(rng.standard_normal(n) * 4) / 4).astype(np.float32)  # many exact ties
    zeros = np.zeros(n, np.float32)
    zeros[rng.choice(n, max(1, n // 50), replace=False)] = 1.0
    negzero = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    negzero[:: max(1, n // 7)] = -3.0
    subnormal = (rng.random(n) * 1e-40).astype(np.float32)  # below float32's smallest normal
    subnormal[rng.integers(0, n)] = 1e-39
    equal = np.full(n, -2.5, np.float32)
    return [("heavy", heavy), ("grid", grid), ("zeros", zeros), ("-0.0", negzero),
            ("subnormal", subnormal), ("all equal", equal)]


def _ks(n):
    return sorted({1, max(1, n // 1000), max(1, n // 100), max(1, n // 3), n})


@pytest.mark.parametrize("n", SIZES)
def test_the_plan_selects_exactly_the_reference_top_k(n):
    for name, x in _adversarial(n, n):
        keys, bad = keys_reference(radix.KEY_ABS, x)
        assert not bad.any()
        for k in _ks(n):
            got = plan_reference(np, keys, k)["selected"]
            np.testing.assert_array_equal(got, selection.topk_reference(x, k),
                                          err_msg=f"{name} n={n} k={k}")


def test_the_plan_with_64_bit_keys_ranks_priority_then_magnitude():
    rng = np.random.default_rng(1)
    prio = rng.integers(0, 4, 5000).astype(np.float32)
    x = (np.round(rng.standard_normal(5000) * 2) / 2).astype(np.float32)
    keys, _ = keys_reference(radix.KEY_FREQ, x, aux=prio)
    order = np.lexsort((np.arange(5000), -np.abs(x).astype(np.float64), -prio))
    for k in (1, 37, 2500, 4999):
        got = plan_reference(np, keys, k, levels=radix.LEVELS_64)["selected"]
        np.testing.assert_array_equal(got, np.sort(order[:k]))


def test_the_plan_leaves_out_zero_keys_when_asked():
    x = np.zeros(100, np.float32)
    x[[5, 50, 99]] = [3.0, 1.0, 2.0]
    keys, _ = keys_reference(radix.KEY_ABS, x)
    assert plan_reference(np, keys, 10, exclude_zero=True)["selected"].tolist() == [5, 50, 99]
    assert plan_reference(np, keys, 2, exclude_zero=True)["selected"].tolist() == [5, 99]
    assert plan_reference(np, keys, 10)["selected"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 50, 99]


# ---------------------------------------------------------------------------- the kernels
def _backends():
    out = [pytest.param(lambda: EmulatedBackend(strict=False), id="emulated"),
           pytest.param(lambda: EmulatedBackend(strict=False, reverse=True), id="reversed")]
    if cupy_or_none() is not None:
        from psparse.backends.cuda import CudaBackend
        out.append(pytest.param(lambda: CudaBackend(cupy_or_none()), id="cuda"))
    return out


@pytest.fixture(scope="module", params=_backends())
def dev(request):
    return request.param()


def _up(dev, a):
    return dev.xp.asarray(a) if dev.xp is not np else np.array(a)


def _down(dev, a):
    return dev.read(a) if dev.xp is not np else np.asarray(a)


def _run(dev, x, segments, ks, key_mode=radix.KEY_ABS, **kw):
    xd = _up(dev, x)
    extra = {name: _up(dev, v) for name, v in kw.pop("arrays", {}).items()}
    key = radix.Key(key_mode, xd, **extra, p0=kw.pop("p0", 0.0))
    engine = RadixSelect(dev, segments, ks, key, values=xd, **kw)
    engine.run()
    report = _down(dev, engine.report).reshape(-1, radix.RP_W)
    idx, val = _down(dev, engine.out_idx), _down(dev, engine.out_val)
    state = _down(dev, engine.state).reshape(-1, radix.ST_W)
    return engine, report, idx, val, state, _down(dev, xd)


@pytest.mark.parametrize("n", SIZES)
def test_the_kernels_follow_the_plan_and_select_the_reference_set(dev, n):
    for name, x in _adversarial(n, 3 * n):
        for k in _ks(n):
            engine, report, idx, val, state, _ = _run(dev, x, [(0, n)], [k])
            keys, _ = keys_reference(radix.KEY_ABS, x)
            plan = plan_reference(np, keys, k)
            where = f"{name} n={n} k={k}"
            assert state[0, radix.ST_MODE] == plan["mode"], where
            if plan["mode"] in (radix.MODE_BUF, radix.MODE_FULL):
                assert state[0, radix.ST_CAND] == plan["candidates"], where
                assert state[0, radix.ST_PREFIX] == plan["threshold"], where
                assert state[0, radix.ST_NEED] == plan["need"], where
            assert report[0].tolist() == [k, 0], where
            np.testing.assert_array_equal(idx[:k], selection.topk_reference(x, k), err_msg=where)
            np.testing.assert_array_equal(val[:k], x[idx[:k]], err_msg=where)


def test_a_segment_that_overflows_its_candidate_buffer_reads_the_whole_segment(dev):
    """Many equal keys at the threshold (zeros): the candidates do not fit (MODE_FULL)."""
    n = 70_000
    x = np.zeros(n, np.float32)
    x[::1000] = 1.0
    engine, report, idx, _, state, _ = _run(dev, x, [(0, n)], [500])
    assert state[0, radix.ST_MODE] == radix.MODE_FULL
    np.testing.assert_array_equal(idx[:500], selection.topk_reference(x, 500))


def test_many_segments_at_once_each_select_their_own(dev):
    rng = np.random.default_rng(4)
    sizes = [5000, 37, 1200, 1, 799, 9000, 16]
    x = np.round(rng.standard_normal(sum(sizes)) * 8).astype(np.float32) / 8
    edges = np.cumsum([0, *sizes])
    segments = list(zip(edges[:-1], edges[1:]))
    ks = [50, 3, 0, 1, 799, 90, 5]
    engine, report, idx, _, _, _ = _run(dev, x, segments, ks)
    for s, ((lo, hi), k) in enumerate(zip(segments, ks)):
        b = engine.obase[s]
        assert report[s, 0] == k
        np.testing.assert_array_equal(idx[b:b + k], selection.topk_reference(x[lo:hi], k) + lo)


def test_non_finite_scores_are_counted_per_segment(dev):
    x = np.random.default_rng(5).standard_normal(10_000).astype(np.float32)
    x[[17, 6000]] = [np.nan, np.inf]
    x[9000] = -np.inf
    _, report, _, _, _, _ = _run(dev, x, [(0, 5000), (5000, 10_000)], [10, 10])
    assert report[:, 1].tolist() == [1, 2]


def test_fused_accumulation_and_take(dev):
    """The first pass folds the gradient in (residual, DGC, filtered); the last one gathers
    and zeroes the selection (and DGC's velocity): the same as the separate steps."""
    rng = np.random.default_rng(6)
    n, k = 9000, 90
    for mode in (radix.ACC_RESIDUAL, radix.ACC_DGC, radix.ACC_FILTERED):
        acc, grad, vel, filt = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
        want_vel = np.float32(0.9) * vel + grad if mode == radix.ACC_DGC else vel
        want = acc + grad if mode == radix.ACC_RESIDUAL else \
            acc + want_vel if mode == radix.ACC_DGC else filt + grad
        chosen = selection.topk_reference(want, k)
        a, g, v, f = (_up(dev, z) for z in (acc, grad, vel, filt))
        engine = RadixSelect(dev, [(0, n)], [k], radix.Key(radix.KEY_ABS, a), values=a,
                             take=True, velocity=v, index_dtype=np.int32)
        engine.run((mode, a, g, v if mode == radix.ACC_DGC else None,
                    f if mode == radix.ACC_FILTERED else None, 0.9))
        idx = _down(dev, engine.out_idx)
        assert idx.dtype == np.int32
        np.testing.assert_array_equal(idx, chosen, err_msg=f"mode {mode}")
        np.testing.assert_array_equal(_down(dev, engine.out_val), want[chosen])
        left = want.copy()
        left[chosen] = 0.0
        np.testing.assert_array_equal(_down(dev, a), left)
        if mode == radix.ACC_DGC:
            vel_left = want_vel.copy()
            vel_left[chosen] = 0.0
            np.testing.assert_array_equal(_down(dev, v), vel_left)


@pytest.mark.parametrize("mode", ["ema", "penalty", "priority", "core", "threshold", "freq"])
def test_every_key_mode_ranks_its_reference_keys(dev, mode):
    rng = np.random.default_rng(7)
    n = 6000
    x = (np.round(rng.standard_normal(n) * 4) / 4).astype(np.float32)
    aux = np.abs(np.round(rng.standard_normal(n), 1)).astype(np.float32)
    mask = (rng.random(n) < 0.1).astype(np.uint8)
    key_mode, p0, arrays, exclude, top = {
        "ema": (radix.KEY_EMA, 16.0, {"aux": aux, "pdev": np.array([aux.max()], np.float32)},
                False, float(aux.max())),
        "penalty": (radix.KEY_PENALTY, 0.25, {"mask": mask}, False, 0.0),
        "priority": (radix.KEY_PRIORITY, 0.0, {"aux": aux}, True, 0.0),
        "core": (radix.KEY_CORE, 0.0, {"mask": mask}, False, 0.0),
        "threshold": (radix.KEY_THRESHOLD, 1.0, {}, True, 0.0),
        "freq": (radix.KEY_FREQ, 0.0, {"aux": aux}, False, 0.0),
    }[mode]
    keys, _ = keys_reference(key_mode, x, aux=aux, mask=mask, p0=p0, top=top)
    levels = radix.LEVELS_64 if key_mode == radix.KEY_FREQ else radix.LEVELS_32
    for k in (1, 60, 3000):
        want = plan_reference(np, keys, k, levels=levels, exclude_zero=exclude)["selected"]
        _, report, idx, _, _, _ = _run(dev, x, [(0, n)], [k], key_mode, p0=p0, arrays=arrays,
                                       exclude_zero=exclude)
        assert report[0, 0] == want.size
        np.testing.assert_array_equal(idx[:want.size], want, err_msg=f"{mode} k={k}")


def test_a_selection_among_earlier_candidates_reads_through_gather(dev):
    rng = np.random.default_rng(8)
    n = 20_000
    x = rng.standard_normal(n).astype(np.float32)
    pool = np.sort(rng.choice(n, 3000, replace=False)).astype(np.int64)
    aux = rng.integers(0, 3, n).astype(np.float32)
    keys, _ = keys_reference(radix.KEY_FREQ, x[pool], aux=aux[pool])
    want = pool[plan_reference(np, keys, 100, levels=radix.LEVELS_64)["selected"]]
    _, _, idx, _, _, _ = _run(dev, x, [(0, 3000)], [100], radix.KEY_FREQ,
                              arrays={"aux": aux, "gather": pool})
    np.testing.assert_array_equal(idx[:100], want)


def test_a_negative_score_is_counted_not_selected_past_k(dev):
    """A key mode read as an unsigned priority over negative values (a user's state, say):
    their sign bit would rank them above everything and the write run past k; they are
    counted as bad instead, and nothing is written beyond a segment's k."""
    rng = np.random.default_rng(9)
    aux = rng.random(10_000).astype(np.float32)
    aux[rng.choice(10_000, 300, replace=False)] *= -1
    aux[:3] = -0.0  # -0.0 is 0, not negative
    _, report, idx, _, _, _ = _run(dev, np.zeros(10_000, np.float32), [(0, 6000), (6000, 10_000)],
                                   [50, 40], radix.KEY_PRIORITY, arrays={"aux": aux})
    negative = aux < 0
    assert report[:, 1].tolist() == [int(negative[:6000].sum()), int(negative[6000:].sum())]
    assert report[:, 0].tolist() == [50, 40]
    assert (idx[:50] < 6000).all() and (idx[50:90] >= 6000).all()


def test_engines_over_empty_segments_launch_nothing_that_writes(dev):
    engine, report, _, _, _, _ = _run(dev, np.zeros(0, np.float32), [(0, 0), (0, 0)], [0, 0])
    assert report.tolist() == [[0, 0], [0, 0]] and engine.total_k == 0


def test_a_selection_is_two_passes_and_at_most_six_launches(dev):
    """A 32-bit top-k: hist0 and write_cand read every entry, the two further levels and the
    final write only the candidates (one launch each: each scan runs in the block that
    completes a histogram, the offsets come from a look-back in the writing launch). 64-bit
    keys add three levels; a selection of all or none is the write alone."""
    rng = np.random.default_rng(10)
    n = 50_000
    x = rng.standard_normal(n).astype(np.float32)
    xd = _up(dev, x)

    def launches(engine, accumulate=None):
        before, names = dev.kernel_launches, len(getattr(dev, "launches", []))
        engine.run(accumulate)
        return dev.kernel_launches - before, getattr(dev, "launches", [])[names:]

    topk = RadixSelect(dev, [(0, n)], [n // 100], radix.Key(radix.KEY_ABS, xd))
    count, names = launches(topk)
    assert count == 5 <= 6
    if names:
        assert names == ["psparse_rs_hist0", "psparse_rs_write_cand", "psparse_rs_hist",
                         "psparse_rs_hist", "psparse_rs_final_i64"]
    freq = RadixSelect(dev, [(0, n)], [n // 100],
                       radix.Key(radix.KEY_FREQ, xd, aux=_up(dev, np.abs(x))))
    assert launches(freq)[0] == 8
    everything = RadixSelect(dev, [(0, n)], [n], radix.Key(radix.KEY_ABS, xd))
    assert launches(everything)[0] == 1
    grad = _up(dev, x)
    assert launches(everything, (radix.ACC_RESIDUAL, xd, grad, None, None, 0.0))[0] == 2


def test_an_engine_run_again_selects_each_time_from_the_new_values(dev):
    """The look-back's flags carry their launch's epoch and the fused scans reset their
    counters: nothing is cleared between runs, and every run (here eight, over two segments,
    one of them through the whole-segment path) selects from the values it is given."""
    rng = np.random.default_rng(11)
    n = 40_000
    xd = _up(dev, np.zeros(n, np.float32))
    engine = RadixSelect(dev, [(0, 30_000), (30_000, n)], [300, 100],
                         radix.Key(radix.KEY_ABS, xd), values=xd)
    for run in range(8):
        x = rng.standard_normal(n).astype(np.float32)
        if run % 3 == 1:  # many equal keys at the threshold: the first segment's MODE_FULL
            x[:30_000] = np.where(rng.random(30_000) < 0.995, 1.0, 2.0)
        xd[...] = _up(dev, x)
        engine.run()
        idx = _down(dev, engine.out_idx)
        report = _down(dev, engine.report).reshape(-1, radix.RP_W)
        assert report[:, 0].tolist() == [300, 100], run
        np.testing.assert_array_equal(idx[:300], selection.topk_reference(x[:30_000], 300))
        np.testing.assert_array_equal(idx[300:], selection.topk_reference(x[30_000:], 100)
                                      + 30_000)
        mode = _down(dev, engine.state).reshape(-1, radix.ST_W)[0, radix.ST_MODE]
        assert mode == (radix.MODE_FULL if run % 3 == 1 else radix.MODE_BUF), run


def test_the_first_pass_arguments_are_checked_once_per_configuration():
    """The signature check of a launch costs Python time per launch; every fixed launch is
    checked when the engine is planned, the first pass once per set of accumulate arrays."""
    checked = []

    class Counting(EmulatedBackend):
        def check(self, name, args):
            checked.append(name)
            super().check(name, args)

    dev = Counting(strict=False)
    n = 9000
    acc, grad = (np.random.default_rng(12).standard_normal(n).astype(np.float32)
                 for _ in range(2))
    engine = RadixSelect(dev, [(0, n)], [90], radix.Key(radix.KEY_ABS, acc), values=acc,
                         take=True)
    planned = len(checked)
    for _ in range(3):
        engine.run((radix.ACC_RESIDUAL, acc, grad, None, None, 0.0))
    assert checked[planned:] == ["psparse_rs_hist0"]
