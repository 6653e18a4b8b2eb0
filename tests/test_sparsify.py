"""Top-k selection: the sampled-threshold path returns exactly the exact path's answer."""

from __future__ import annotations

import numpy as np
import pytest

from psparse.ops.select.sparsify import Selector, density_to_k, split_k, topk_exact
from psparse.policies import Layout, TopK


def reference_topk(x, k):
    """Sorted indices of the k largest |x|, by a full sort (ties broken by lower index)."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    return np.sort(order[:k])


@pytest.mark.parametrize("n, k", [(10, 1), (10, 10), (1000, 7), (61706, 617), (5, 0)])
def test_exact_topk_matches_full_sort(n, k):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = topk_exact(x, k)
    np.testing.assert_array_equal(got, reference_topk(x, k))
    assert np.all(np.diff(got) > 0)


@pytest.mark.parametrize("n, density", [(1 << 20, 0.001), (3_000_017, 0.01), (2_000_000, 1e-6)])
def test_threshold_selection_is_exact(n, density):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32) * rng.random(n).astype(np.float32) ** 4
    k = density_to_k(density, n)
    sel = Selector(n, exact_below=0)
    got = sel.topk(x, k)
    assert got.size == k
    np.testing.assert_array_equal(got, reference_topk(x, k))


def test_threshold_falls_back_to_exact_when_the_sample_misleads():
    # every sampled position (multiples of the stride) holds a huge value: the estimated
    # threshold is far too high, so the candidate pass finds fewer than k and must fall back
    n, k = 1 << 20, 20_000
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x[::97] = 1000.0
    sel = Selector(n, exact_below=0)
    got = sel.topk(x, k)
    np.testing.assert_array_equal(got, reference_topk(x, k))
    assert sel.fallbacks == 1


def test_ties_give_exactly_k_and_are_deterministic():
    x = np.ones(2_000_000, dtype=np.float32)
    x[::3] = -1.0
    sel = Selector(x.size, exact_below=0)
    a, b = sel.topk(x, 1000), sel.topk(x, 1000)
    assert a.size == 1000 and np.array_equal(a, b) and np.all(np.diff(a) > 0)


def test_split_k_gives_every_layer_one_entry_then_splits_the_rest_by_size():
    sizes = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]  # LeNet-5's tensors
    ks = split_k(617, sizes)
    assert sum(ks) == 617 and min(ks) >= 1  # the biases too (a share of 0.06-0.8 each)
    for k_l, s in zip(ks, sizes):  # one each, then 607 in proportion to the rest
        assert abs(k_l - 1 - 607 * (s - 1) / (sum(sizes) - len(sizes))) < 1
    assert split_k(3, [1, 1, 1, 1]) == [1, 1, 1, 0]  # fewer than layers: the largest first
    assert split_k(2, [1, 5, 1, 9]) == [0, 1, 0, 1]
    assert split_k(100, [2, 3]) == [2, 3]
    assert split_k(17, [5, 1, 7, 4]) == [5, 1, 7, 4]
    assert split_k(2, [0, 0, 5]) == [0, 0, 2] and split_k(5, [3, 0, 4]) == [2, 0, 3]
    rng = np.random.default_rng(0)
    for _ in range(300):  # any sizes: sums to min(k, total), within each layer, one each first
        sizes = [int(s) for s in rng.integers(0, 40, int(rng.integers(1, 12)))]
        k = int(rng.integers(0, sum(sizes) + 5))
        ks = split_k(k, sizes)
        assert sum(ks) == min(k, sum(sizes)) and all(0 <= a <= s for a, s in zip(ks, sizes))
        if k >= sum(s > 0 for s in sizes):
            assert all(a >= 1 for a, s in zip(ks, sizes) if s > 0)


def test_per_layer_topk_picks_each_layers_own_largest():
    sizes = [10, 30, 60]
    x = np.zeros(100, np.float32)
    x[[2, 3]] = [5, 4]          # layer 0
    x[[15, 20, 35]] = [1, 2, 3]  # layer 1
    x[40:100] = np.linspace(0.1, 0.7, 60)
    whole = TopK(Layout(sizes, "model"), 10).select(x, 0)
    per_layer = TopK(Layout(sizes, "layer"), 10).select(x, 0)
    assert whole.size == per_layer.size == 10
    # split_k(10, sizes) = [2, 3, 5]: one each, then 7 by the sizes beyond it
    assert set(per_layer[per_layer < 10]) == {2, 3}
    assert set(per_layer[(per_layer >= 10) & (per_layer < 40)]) == {20, 35, 15}
    assert set(whole[whole < 40]) == {2, 3, 15, 20, 35}


def test_density_to_k():
    assert density_to_k(0.01, 61706) == 617
    assert density_to_k(1e-9, 100) == 1
    assert density_to_k(1.0, 100) == 100
    with pytest.raises(ValueError, match="density"):
        density_to_k(0, 10)
