"""The server's round arithmetic (psparse/server/aggregation.py) on numpy arrays, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from psparse.backends.cuda import CudaBackend
from psparse.backends.emulated import EmulatedBackend
from psparse.server.aggregation import Aggregator, BudgetError, ServerLimit, array_module_for
from psparse.xp import cupy_or_none


def arr(*values, dtype=np.float32):
    return np.array(values, dtype=dtype)


def idx(*values):
    return np.array(values, dtype=np.int64)


# ------------------------------------------------------------------------------------- mean
def test_mean_is_the_union_and_the_mean_over_all_pushes():
    agg = Aggregator(10)
    union, mean = agg.mean([idx(1, 5), idx(5, 8), idx()], [arr(3, 6), arr(3, 9), arr()])
    assert union.tolist() == [1, 5, 8]
    # divided by the number of pushes (3), an index a push lacks counts 0 for it
    assert mean.tolist() == pytest.approx([1.0, 3.0, 3.0])
    assert mean.dtype == np.float32
    assert not np.any(agg.accumulator)  # the scratch is left zeroed for the next round


def test_mean_sums_in_rank_order():
    """float32 sums depend on order: the result is that of adding the pushes in list order."""
    agg = Aggregator(4)
    values = [arr(1e8), arr(1.0), arr(-1e8)]  # 1e8 + 1 rounds to 1e8 in float32
    _, mean = agg.mean([idx(2)] * 3, values)
    in_order = (np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)
    assert mean.tolist() == [in_order / np.float32(3)] == [0.0]
    _, other = agg.mean([idx(2)] * 3, [values[0], values[2], values[1]])
    assert other.tolist() == [np.float32(1.0) / np.float32(3)]  # a different order, another sum


def test_mean_of_many_random_pushes_matches_a_float32_reference():
    rng = np.random.default_rng(0)
    numel, n = 500, 6
    pushes = []
    for _ in range(n):
        k = int(rng.integers(0, 80))
        pushes.append((np.sort(rng.choice(numel, k, replace=False)),
                       rng.standard_normal(k).astype(np.float32)))
    agg = Aggregator(numel)
    union, mean = agg.mean([p[0] for p in pushes], [p[1] for p in pushes])
    reference = np.zeros(numel, np.float32)
    for i, v in pushes:
        reference[i] += v  # rank order, float32, one push at a time
    expected = np.unique(np.concatenate([p[0] for p in pushes]))
    assert np.array_equal(union, expected)
    assert np.array_equal(mean, reference[expected] / np.float32(n))


def test_a_dense_push_covers_every_index():
    agg = Aggregator(6)
    dense = arr(0, 1, 0, 2, 0, -4)
    union, mean = agg.mean([None, idx(0, 3)], [dense, arr(4, 2)])
    assert union.tolist() == [0, 1, 2, 3, 4, 5]
    assert mean.tolist() == [2.0, 0.5, 0.0, 2.0, 0.0, -2.0]
    assert np.array_equal(agg.all_indices, np.arange(6))


def test_no_pushes_give_an_empty_aggregate():
    union, mean = Aggregator(5).mean([], [])
    assert union.size == 0 and mean.size == 0


# ------------------------------------------------------------------------------------- vote
def test_vote_keeps_the_largest_mean_magnitude():
    agg = Aggregator(20)
    # |values|: index 3 -> (5 + 5) / 2 = 5 (opposite signs do not cancel), 7 -> 4 / 2 = 2,
    # 9 -> 3 / 2, 12 -> (1 + 6) / 2 = 3.5
    chosen, proposed = agg.vote([idx(3, 7, 12), idx(3, 9, 12)],
                                [arr(5, 4, 1), arr(-5, 3, -6)], keep=2)
    assert chosen.tolist() == [3, 12]
    assert proposed == 4
    assert not np.any(agg.accumulator)


def test_vote_ties_go_to_the_lower_index_and_the_result_is_sorted():
    agg = Aggregator(20)
    chosen, proposed = agg.vote([idx(2, 4, 11, 15)], [arr(1, -3, 3, 3)], keep=2)
    assert chosen.tolist() == [4, 11]  # 4, 11 and 15 tie at 3: the two lower indices
    assert proposed == 4


def test_vote_keeps_everything_when_fewer_were_proposed():
    agg = Aggregator(20)
    chosen, proposed = agg.vote([idx(8), idx(), idx(1, 8)], [arr(1), arr(), arr(0, 2)], keep=5)
    assert chosen.tolist() == [1, 8] and proposed == 2
    chosen, proposed = agg.vote([idx(), idx()], [arr(), arr()], keep=3)
    assert chosen.size == 0 and proposed == 0


# ----------------------------------------------------------------------------------- budget
STEP = (10, 4, 6)  # (budget, push_max, propose_max)


def test_push_and_proposal_within_their_caps_pass():
    agg = Aggregator(100)
    agg.check_budget("push", 3, STEP, 4)
    agg.check_budget("propose", 3, STEP, 6)
    agg.check_budget("push", 3, STEP, 0)


def test_push_over_the_cap_is_refused_naming_the_step():
    agg = Aggregator(100)
    with pytest.raises(BudgetError) as exc:
        agg.check_budget("push", 3, STEP, 5)
    assert str(exc.value) == ("push has 5 entries, more than the cap of 4 at iteration 3 "
                              "(agreed run, step [10, 4, 6])")


def test_proposal_is_held_to_propose_max_not_push_max():
    agg = Aggregator(100)
    agg.check_budget("propose", 0, STEP, 5)  # > push_max, <= propose_max
    with pytest.raises(BudgetError, match=r"^propose has 7 entries, more than the cap of 6 at "
                                          r"iteration 0"):
        agg.check_budget("propose", 0, STEP, 7)


def test_the_dense_switch_uses_the_natural_index_size():
    agg = Aggregator(12)  # int32 indices: count x 8 > 12 x 4 from 7 entries on
    assert agg.index_dtype == "int32"
    assert not agg.goes_dense(6) and agg.goes_dense(7)  # (int64 would switch from 5 on)


def test_a_dense_push_under_a_sparse_cap_is_refused():
    agg = Aggregator(12)
    dense = np.zeros(12, np.float32)
    dense[:2] = 1.0  # only 2 nonzero values, but the cap of 6 entries goes sparse
    with pytest.raises(BudgetError) as exc:
        agg.check_budget("push", 2, (6, 6, 0), 12, dense_values=dense)
    assert str(exc.value) == ("dense push refused: the push cap at iteration 2 is 6 of 12 "
                              "entries, which go sparse")


def test_a_dense_push_counts_its_nonzero_values_against_the_cap():
    agg = Aggregator(12)
    dense = np.zeros(12, np.float32)
    dense[:7] = 1.0
    dense[7] = -0.0  # -0.0 is zero
    agg.check_budget("push", 0, (7, 7, 0), 12, dense_values=dense)  # exactly at the cap
    dense[8] = 0.5
    with pytest.raises(BudgetError) as exc:
        agg.check_budget("push", 0, (7, 7, 0), 12, dense_values=dense)
    assert str(exc.value) == ("dense push has 8 nonzero entries, more than the push cap of 7 "
                              "at iteration 0")


def test_densify_writes_the_whole_vector():
    agg = Aggregator(6)
    agg.densify(idx(0, 1, 2, 3), arr(9, 9, 9, 9))
    out = agg.densify(idx(1, 4), arr(2, -3))
    assert out.tolist() == [0, 2, 0, 0, -3, 0]  # nothing left from the previous round


# ------------------------------------------------------------------------------------ limit
def test_limit_holds_what_it_cuts_and_sends_it_later():
    agg, lim = Aggregator(10), ServerLimit(10, (2, "entries"))
    union, mean = agg.mean([idx(1, 3, 5, 7, 9)], [arr(1, -5, 2, 4, -3)])
    sent = {}
    idx_, val = lim.apply(union, mean, 2)
    assert idx_.tolist() == [3, 7] and val.tolist() == [-5, 4]
    assert lim.support.tolist() == [1, 5, 9]
    sent.update(zip(idx_.tolist(), val.tolist()))
    for _ in range(3):  # rounds without pushes drain what is held, largest first
        union, mean = agg.mean([idx()], [arr()])
        idx_, val = lim.apply(union, mean, 2)
        assert idx_.size <= 2 and np.all(np.diff(idx_) > 0)
        for i, v in zip(idx_.tolist(), val.tolist()):
            assert i not in sent
            sent[i] = v
    assert sent == {1: 1.0, 3: -5.0, 5: 2.0, 7: 4.0, 9: -3.0}  # everything, exactly once
    assert lim.support.size == 0 and not np.any(lim.residual)


def test_limit_adds_what_it_held_to_the_next_rounds_aggregate():
    lim = ServerLimit(10, (1, "entries"))
    idx_, val = lim.apply(idx(2, 6), arr(1.0, 3.0), 1)
    assert idx_.tolist() == [6] and lim.support.tolist() == [2]
    idx_, val = lim.apply(idx(2, 4), arr(0.5, 1.0), 1)
    assert idx_.tolist() == [2] and val.tolist() == [1.5]  # held 1.0 + this round's 0.5
    assert lim.support.tolist() == [4]


@pytest.mark.parametrize("limit", [1, 5, 30])
def test_limit_conserves_every_pushed_value(limit):
    """Invariant: sum of the rounds' means = sum of what was broadcast + what is held."""
    rng = np.random.default_rng(limit)
    numel, n = 200, 3
    agg, lim = Aggregator(numel), ServerLimit(numel, (limit, "entries"))
    means, sent = np.zeros(numel), np.zeros(numel)
    for _ in range(25):
        pushes = [np.sort(rng.choice(numel, int(rng.integers(0, 20)), replace=False))
                  for _ in range(n)]
        values = [rng.standard_normal(p.size).astype(np.float32) for p in pushes]
        union, mean = agg.mean(pushes, values)
        means[union] += mean
        i, v = lim.apply(union, mean, limit)
        assert i.size <= limit and np.all(np.diff(i) > 0)
        sent[i] += v
    held = np.zeros(numel)
    held[lim.support] = lim.residual[lim.support]
    np.testing.assert_allclose(means, sent + held, atol=1e-5)
    assert lim.support.size > 0  # the cap did cut something in these rounds
    assert np.count_nonzero(lim.residual) <= lim.support.size


def test_limit_entries_per_unit():
    assert ServerLimit(10, (5000, "entries")).entries(100, 8) == 5000
    assert ServerLimit(10, (2.0, "k")).entries(617, 4) == 1234
    assert ServerLimit(10, (0.001, "k")).entries(100, 4) == 1  # never below one entry
    assert ServerLimit(10, (0, "Nk")).entries(100, 8) == 800


# ----------------------------------------------------------------------------------- device
def test_server_device():
    assert array_module_for("cpu") is None
    if cupy_or_none() is None:
        with pytest.raises(ValueError, match="--server-device cuda: no CUDA device"):
            array_module_for("cuda")


def _device_backend():
    cupy = cupy_or_none()
    return CudaBackend(cupy) if cupy is not None else EmulatedBackend(strict=True)


def test_the_device_aggregator_is_the_hosts():
    """--server-device cuda's arithmetic (emulated on the CPU, on CUDA when present): the same
    union, its index dtype, the same means and votes, bit for bit."""
    rng = np.random.default_rng(1)
    pushes = [np.sort(rng.choice(300, 40, replace=False)).astype(np.int32) for _ in range(4)]
    values = [rng.standard_normal(40).astype(np.float32) for _ in range(4)]
    host, device = Aggregator(300), Aggregator(300, _device_backend())
    (hu, hm), (du, dm) = host.mean(pushes, values), device.mean(pushes, values)
    assert isinstance(du, np.ndarray) and du.dtype == hu.dtype
    assert np.array_equal(hu, du) and np.array_equal(hm, dm)
    for a, b in zip(host.candidates(pushes, values, 10), device.candidates(pushes, values, 10)):
        assert np.array_equal(a, b)
    dense = [None, pushes[1]], [rng.standard_normal(300).astype(np.float32), values[1]]
    (hu, hm), (du, dm) = host.mean(*dense), device.mean(*dense)
    assert du.dtype == hu.dtype and np.array_equal(hu, du) and np.array_equal(hm, dm)
