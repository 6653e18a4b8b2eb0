"""Top-k selection: the sampled-threshold path returns exactly the exact path's answer."""

from __future__ import annotations

import numpy as np
import pytest

from psparse.cpu.sparsify import Selector, density_to_k, split_k, topk_exact
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


def test_split_k_is_proportional_and_sums_to_k():
    sizes = [156, 2416, 48120, 10164, 850]  # LeNet-5 layers (weights+biases merged)
    ks = split_k(617, sizes)
    assert sum(ks) == 617
    for k_l, s in zip(ks, sizes):
        assert abs(k_l - 617 * s / sum(sizes)) < 1
    assert split_k(3, [1, 1, 1, 1]) == [1, 1, 1, 0]
    assert split_k(100, [2, 3]) == [2, 3]


def test_per_layer_topk_picks_each_layers_own_largest():
    sizes = [10, 30, 60]
    x = np.zeros(100, np.float32)
    x[[2, 3]] = [5, 4]          # layer 0
    x[[15, 20, 35]] = [1, 2, 3]  # layer 1
    x[40:100] = np.linspace(0.1, 0.7, 60)
    whole = TopK(Layout(sizes, "model"), 10).select(x, 0)
    per_layer = TopK(Layout(sizes, "layer"), 10).select(x, 0)
    assert whole.size == per_layer.size == 10
    assert set(per_layer[per_layer < 10]) == {2}  # k_0 = 1
    assert set(per_layer[(per_layer >= 10) & (per_layer < 40)]) == {20, 35, 15}
    assert set(whole[whole < 40]) == {2, 3, 15, 20, 35}


def test_density_to_k():
    assert density_to_k(0.01, 61706) == 617
    assert density_to_k(1e-9, 100) == 1
    assert density_to_k(1.0, 100) == 100
    with pytest.raises(ValueError, match="density"):
        density_to_k(0, 10)
