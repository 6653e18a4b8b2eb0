"""--server-device cuda's arithmetic (psparse/ops/aggregate/device_aggregation.py) equals the host's, bit for
bit: sums in rank order, the union in index order from touched bytes (no sort), the mean; the
scratch left zeroed. On the emulated backend (the CUDA C on the CPU); on CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest

from psparse.backends.cuda import CudaBackend
from psparse.backends.emulated import EmulatedBackend
from psparse.ops.aggregate.device_aggregation import DeviceAggregator
from psparse.ops.aggregate.reference import sparse_mean
from psparse.xp import cupy_or_none


@pytest.fixture(scope="module")
def dev():
    cupy = cupy_or_none()
    return CudaBackend(cupy) if cupy is not None else EmulatedBackend(strict=True)


def _pushes(rng, n, kind):
    idx = [np.sort(rng.choice(n, 400, replace=False)) for _ in range(5)]
    if kind == "duplicates":  # every push at the same indices
        idx = [idx[0]] * 5
    if kind == "disjoint":
        idx = [np.arange(r, n, 5)[:400] for r in range(5)]
    val = [rng.standard_normal(i.size).astype(np.float32) for i in idx]
    if kind == "empty push":
        idx[2], val[2] = np.empty(0, np.int64), np.empty(0, np.float32)
    if kind == "dense push":
        idx[1], val[1] = None, rng.standard_normal(n).astype(np.float32)
    if kind == "last index":
        idx[0], val[0] = np.array([n - 1]), np.array([3.5], np.float32)
    return idx, val


@pytest.mark.parametrize("kind", ["random", "duplicates", "disjoint", "empty push",
                                  "dense push", "last index"])
def test_the_device_mean_is_the_hosts(dev, kind):
    rng = np.random.default_rng(len(kind))
    n = 30_011
    aggregator = DeviceAggregator(n, dev)
    for _ in range(2):  # twice: the scratch must be clean for the next round
        indices, values = _pushes(rng, n, kind)
        host = sparse_mean(np.zeros(n, np.float32),
                           [np.arange(n) if i is None else i for i in indices], values)
        union, mean = aggregator.mean(indices, values)
        np.testing.assert_array_equal(union, host[0])
        np.testing.assert_array_equal(mean, host[1])
        assert not dev.read(aggregator.sum).any() and not dev.read(aggregator.touched).any()


def test_a_round_makes_one_copy_back(dev):
    aggregator = DeviceAggregator(1000, dev)
    before = dev.copy_backs
    aggregator.mean([np.array([1, 5]), np.array([5, 7])], [np.ones(2, np.float32)] * 2)
    assert dev.copy_backs == before + 1
