"""The host's compiled selection and policy-state kernels (psparse/ops/select/select_kernels.py) against
their numpy oracles: ``topk_exact`` of the same score, ``kernels.at_least``,
``kernels.scatter_add`` and ``Decaying.renormalise``'s numpy lines. Random, adversarial
(empty, one entry, ties, all equal, zeros, k = 0 and k = n, a misleading sample) and
``hypothesis`` inputs; NaN and inf refused where the references refuse them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psparse.ops.feedback import updates
from psparse.ops.select import select_kernels, selection
from psparse.ops.select.selection import NonFiniteError
from psparse.ops.select.sparsify import Selector, topk_exact

CORE_SCORE = np.finfo(np.float32).max
GRID = st.sampled_from([0.0, 0.125, -0.125, 0.5, -1.0, 2.0, 3.0, 1e-30, -1e-39])  # ties


def reference_score(kind, acc, aux, marks, p):
    """The score the policies' numpy code writes (ema's, penalty's, core's)."""
    mag = np.abs(acc)
    if kind == select_kernels.EMA:
        return np.abs((aux + np.float32(p)) * acc)
    if kind == select_kernels.PENALTY:
        out = mag * np.float32(p)
        out[marks] = mag[marks]
        return out
    if kind == select_kernels.CORE:
        mag[marks] = CORE_SCORE
    return mag


def compiled(kind, acc, k, aux=None, marks=None, p=1.0):
    q = float(np.float32(aux.max()) + np.float32(p)) if aux is not None and aux.size else p
    return Selector(acc.size).scored(acc, k, kind, aux, marks, p, q)


def inputs(rng, n, ties):
    acc = (rng.standard_normal(n) * rng.standard_normal(n) ** 3).astype(np.float32)
    if ties:
        acc = np.round(acc * 4) / np.float32(4)  # many equal magnitudes
    aux = np.abs(rng.standard_normal(n)).astype(np.float32)
    aux[rng.random(n) < 0.5] = 0.0
    marks = np.sort(rng.choice(n, n // 7, replace=False)).astype(np.int64)
    return acc, aux, marks


@pytest.mark.parametrize("kind", [select_kernels.ABS, select_kernels.EMA,
                                  select_kernels.PENALTY, select_kernels.CORE])
@pytest.mark.parametrize("n, ties", [(1, False), (2, True), (300, True), (7037, False),
                                     (200_003, True)])
def test_top_k_equals_the_exact_top_k_of_the_score(kind, n, ties):
    rng = np.random.default_rng(n + kind)
    acc, aux, marks = inputs(rng, n, ties)
    p = 0.25 if kind == select_kernels.PENALTY else 0.0625
    aux = aux if kind == select_kernels.EMA else None
    marks = marks if kind in (select_kernels.PENALTY, select_kernels.CORE) else None
    score = reference_score(kind, acc, aux, marks, p)
    for k in sorted({0, 1, n // 1000, n // 100, n // 7, n - 1, n}):
        want = topk_exact(score, k, nonnegative=True)
        np.testing.assert_array_equal(compiled(kind, acc, k, aux, marks, p), want,
                                      err_msg=f"kind {kind} n {n} k {k}")


@pytest.mark.parametrize("pi", [1.0, 0.5, 0.3, 1e-3])
def test_penalty_at_every_pi(pi):
    """PENALTY collects |acc| >= about t / pi and merges the marks in afterwards: exact at pi
    = 1 (no penalty), at a pi whose division rounds, and at a tiny one (every mark first)."""
    rng = np.random.default_rng(int(pi * 1000))
    for n, ties in ((7037, True), (200_003, False)):
        acc, _, marks = inputs(rng, n, ties)
        score = reference_score(select_kernels.PENALTY, acc, None, marks, pi)
        for k in (1, n // 100, n // 7):
            np.testing.assert_array_equal(
                compiled(select_kernels.PENALTY, acc, k, None, marks, pi),
                topk_exact(score, k, nonnegative=True), err_msg=f"pi {pi} n {n} k {k}")


@pytest.mark.parametrize("k", [5, 15])
def test_penalty_on_subnormal_scores(k):
    """pi * |acc| rounds to a subnormal with a large relative error: the pass's bound may not
    assume 2**-20 of slack there (every score here is 2**-149; ties go to the lowest index)."""
    bits = np.full(2000, 3, np.uint32)
    bits[100:110] = 4
    acc = bits.view(np.float32)
    marks = np.empty(0, np.int64)
    score = reference_score(select_kernels.PENALTY, acc, None, marks, 0.25)
    np.testing.assert_array_equal(compiled(select_kernels.PENALTY, acc, k, None, marks, 0.25),
                                  topk_exact(score, k, nonnegative=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(GRID, min_size=1, max_size=400), st.data())
def test_top_k_on_tied_grids(values, data):
    acc = np.array(values, np.float32)
    k = data.draw(st.integers(0, acc.size))
    np.testing.assert_array_equal(Selector(acc.size).topk(acc, k), topk_exact(acc, k))


def test_a_misleading_sample_and_all_equal_values_stay_exact():
    n = 300_007
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x[::97] = 1000.0  # every sampled entry huge: too few candidates, the exact k-th is used
    selector = Selector(n)
    np.testing.assert_array_equal(selector.topk(x, 20_000), topk_exact(x, 20_000))
    assert selector.fallbacks == 1
    same = np.full(n, -0.5, np.float32)  # every entry tied: more candidates than the buffer
    np.testing.assert_array_equal(selector.topk(same, 3000), np.arange(3000))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_scores_are_refused_where_the_reference_refuses_them(bad):
    n = 50_000
    for where in (0, 97, 12_345, n - 1):
        acc = np.random.default_rng(where).standard_normal(n).astype(np.float32)
        acc[where] = bad
        for kind in (select_kernels.ABS, select_kernels.PENALTY):
            with pytest.raises(NonFiniteError, match=f"NaN or inf \\(first at index {where}\\)"):
                compiled(kind, acc, 50, marks=np.array([3], np.int64), p=0.5)
        # core: a core entry's score is float32's maximum, whatever its |acc| (as the reference)
        got = compiled(select_kernels.CORE, acc, 50, marks=np.array([where], np.int64))
        assert where in got


def test_frequency_top_k_equals_its_rule():
    rng = np.random.default_rng(3)
    for n, k, pool in ((50, 5, 20), (7037, 70, 280), (200_003, 2000, 8000)):
        acc, stored, _ = inputs(rng, n, ties=True)
        stored = np.round(stored * 2).astype(np.float32)  # few distinct counts: ties
        candidates = topk_exact(acc, pool)
        key = (stored[candidates].view(np.uint32).astype(np.uint64) << np.uint64(32)) | \
            np.abs(acc[candidates]).view(np.uint32)
        order = np.lexsort((candidates, ~key))  # largest key first, then the lower index
        want = np.sort(candidates[order[:k]])
        out = np.empty(k, np.int64)
        assert select_kernels.frequency_top_k(acc, stored, pool, k, out) >= 0
        np.testing.assert_array_equal(out, want, err_msg=f"n {n}")


def test_at_least_equals_the_reference():
    rng = np.random.default_rng(4)
    for n in (0, 1, 17, 63, 64, 65, 200_003):
        acc = rng.standard_normal(n).astype(np.float32)
        if n > 17:
            acc[[5, 70 % n, 300 % n]] = [np.nan, np.inf, -np.inf]
            acc[1000 % n] = np.float32(0.7)  # at a lam whose float32 rounds down: selected
        got = select_kernels.at_least(acc, np.float32(0.7))
        np.testing.assert_array_equal(got, selection.at_least(acc, 0.7, np.empty(64, np.float32)))


@pytest.mark.parametrize("hits", [0.0, 0.001, 0.06, 0.5, 1.0])
def test_at_least_at_every_hit_rate(hits):
    """Blocks of 64 with no hit, a few (the branch-free first four), many (the loop after
    them) and all; the tail of fewer than 64 one by one; -0.0, subnormals and huge values."""
    rng = np.random.default_rng(int(hits * 1000))
    for n in (64 * 37 + 29, 64 * 500):
        acc = rng.uniform(-0.5, 0.5, n).astype(np.float32)
        chosen = rng.random(n) < hits
        acc[chosen] = (rng.choice([-1, 1], chosen.sum())
                       * rng.uniform(1.0, 3e38, chosen.sum())).astype(np.float32)
        acc[:4] = [-0.0, 1e-45, -np.float32(1.0), np.float32(1.0)]
        got = select_kernels.at_least(acc, np.float32(1.0))
        np.testing.assert_array_equal(got, np.flatnonzero(np.abs(acc) >= 1.0))
        np.testing.assert_array_equal(got, selection.at_least(acc, 1.0, np.empty(64, np.float32)))


def test_scatter_add_and_renormalise_equal_numpy_bit_for_bit():
    rng = np.random.default_rng(5)
    n = 20_011
    state = (rng.standard_normal(n) * 1e-37).astype(np.float32)  # subnormals in
    indices = np.sort(rng.choice(n, 3000, replace=False))
    values = rng.standard_normal(indices.size).astype(np.float32)
    edges = np.array([0, 5000, n], np.int64)
    for dtype in (np.int32, np.int64):
        for mode, vals, magnitude in ((0, values, True), (1, values, False), (2, None, True)):
            got, want = state.copy(), state.copy()
            old, updated = np.empty(indices.size, np.float32), np.empty(indices.size, np.float32)
            tops = np.zeros(2, np.float32)
            select_kernels.scatter_add(got, indices.astype(dtype),
                                       select_kernels.NO_AUX if vals is None else vals,
                                       np.float32(0.1), mode, old, updated, edges, tops)
            updates.scatter_add(want, indices, vals, 0.1, magnitude)
            assert got.tobytes() == want.tobytes()
            assert old.tobytes() == state[indices].tobytes()
            assert updated.tobytes() == want[indices].tobytes()
            assert tops.tolist() == [max(0.0, float(want[indices[indices < 5000]].max())),
                                     max(0.0, float(want[indices[indices >= 5000]].max()))]
    got, want = state.copy(), state.copy()
    select_kernels.renormalise(got, np.float32(2.0 ** -65))
    want *= np.float32(2.0 ** -65)
    want[np.abs(want) < np.finfo(np.float32).tiny] = 0.0
    assert got.tobytes() == want.tobytes()
