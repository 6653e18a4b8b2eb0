"""Kernels against their references: selection, error feedback, policy state, aggregation.

The CPU tests always run. The device tests run the GPU path's kernels through a backend and
compare them with the numpy path: the emulated backend (the CUDA C on the CPU) always, CuPy on
a CUDA device when there is one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from psparse.backends.cuda import CudaBackend
from psparse.backends.emulated import EmulatedBackend
from psparse.ops import sources
from psparse.ops.feedback import updates
from psparse.ops.select import selection
from psparse.ops.select.selection import NonFiniteError
from psparse.ops.select.sparsify import Selector, topk_exact
from psparse.policies.memory import Memory
from psparse.wire import protocol
from psparse.xp import array_module, cupy_or_none, from_torch, to_device, to_host, to_torch

cupy = cupy_or_none()

# sizes that are not multiples of the CPU block (65,536) or of the CUDA block (256)
SIZES = [1, 7, 1000, 65_537, 1_048_583]


def _cases():
    for n in SIZES:
        for k in sorted({1, max(1, n // 1000), max(1, n // 100), n}):
            yield n, k


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _raw_aggregate(indices, values):
    """An aggregate as the protocol delivers it in the ``raw`` index format: int32 indices."""
    frames = protocol.encode("aggregate", indices.astype(np.int32), values, iter=0, workers=1)
    return protocol.decode([bytes(f) for f in frames])


# ---------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("n,k", list(_cases()))
def test_cpu_selection_equals_the_reference(n, k):
    x = _data(n, n + k)
    want = selection.topk_reference(x, k)
    np.testing.assert_array_equal(Selector(n, exact_below=0).topk(x, k), want)
    np.testing.assert_array_equal(topk_exact(x, k), want)
    idx, val = selection.select_any(x, k)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(val, x[want])


@pytest.mark.parametrize("n", [1000, 200_003])
def test_ties_go_to_the_lower_index_on_every_path(n):
    x = np.zeros(n, np.float32)
    x[::3] = 2.0
    x[1::3] = -2.0  # same magnitude, other sign
    k = n // 2  # cuts through the tied +-2 block
    want = np.flatnonzero(np.abs(x) == 2.0)[:k]
    np.testing.assert_array_equal(selection.topk_reference(x, k), want)
    np.testing.assert_array_equal(Selector(n, exact_below=0).topk(x, k), want)
    np.testing.assert_array_equal(topk_exact(x, k), want)
    # more zeros than the sample expects: the exact-threshold fallback with many ties
    z = np.zeros(n, np.float32)
    z[5] = 1.0
    np.testing.assert_array_equal(Selector(n, exact_below=0).topk(z, 10),
                                  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_accumulators_are_refused(bad):
    for n in (1000, 300_000):
        x = _data(n, 1)
        x[n // 2] = bad
        with pytest.raises(NonFiniteError, match="NaN or inf"):
            Selector(n, exact_below=0).topk(x, 10)
        with pytest.raises(NonFiniteError, match="NaN or inf"):
            topk_exact(x, 10)


def test_dgc_accumulate_and_take_follow_the_formulas():
    rng = np.random.default_rng(2)
    mem = Memory(1000, "dgc", momentum=0.9)
    u = np.zeros(1000, np.float32)
    acc = np.zeros(1000, np.float32)
    for _ in range(3):
        g = rng.standard_normal(1000).astype(np.float32)
        u = np.float32(0.9) * u + g
        acc = acc + u
        mem.add(g)
    np.testing.assert_allclose(mem.accumulator, acc, rtol=1e-6)
    idx = np.array([3, 500, 999])
    np.testing.assert_array_equal(mem.take(idx), acc[idx])
    assert not mem.accumulator[idx].any() and not mem.velocity[idx].any()
    assert mem.accumulator[4] == pytest.approx(acc[4])


def test_policy_state_updates_follow_the_formulas():
    p = np.arange(10, dtype=np.float32)
    updates.decay_and_add(p, np.array([1, 4]), np.array([-2.0, 3.0], np.float32), 0.5, 0.25)
    want = np.arange(10, dtype=np.float32) * 0.5
    want[[1, 4]] += [0.5, 0.75]
    np.testing.assert_allclose(p, want)
    updates.decay_and_add(p, np.array([1]), np.array([-2.0], np.float32), 1.0, 1.0,
                          magnitude=False)
    assert p[1] == pytest.approx(want[1] - 2.0)
    c = np.ones(5, np.float32)
    updates.decay_and_count(c, np.array([0, 2]), 0.5)
    np.testing.assert_allclose(c, [1.5, 0.5, 1.5, 0.5, 0.5])


def test_torch_tensors_cross_without_a_copy_on_the_cpu():
    t = torch.zeros(8)
    a = from_torch(t)
    a[3] = 5.0
    assert t[3] == 5.0 and array_module(a) is np
    back = to_torch(a)
    back[4] = 7.0
    assert t[4] == 7.0 and to_host(a) is a



def test_received_int32_indices_become_int64_once_at_the_device_boundary():
    idx = np.array([3, 17, 4000, 65_000], np.int64)
    msg = _raw_aggregate(idx, np.ones(4, np.float32))
    assert msg.indices.dtype == np.int32  # raw frames decode as views of what was sent
    got_idx, got_val = to_device(np, msg.indices, msg.values)
    assert got_idx.dtype == np.int64 and got_idx.tolist() == idx.tolist()
    assert got_val is msg.values  # floats pass through untouched
    assert to_device(np, idx)[0] is idx  # int64 host indices are not copied


def test_kernel_launches_are_checked_against_the_c_signatures():
    """Every CUDA parameter type is known, and a launch with a wrong dtype, count, layout or
    scalar type is a TypeError naming the kernel and the parameter (not a silent misread)."""
    import re
    names = re.findall(r'__global__\s+void\s+(\w+)', sources.CUDA_SOURCE)
    assert sorted(names) == sorted(sources.CUDA_KERNELS)
    assert all(c in sources.C_TYPES for sig in sources.CUDA_KERNELS.values() for c, _ in sig)
    sig = sources.CUDA_KERNELS["psparse_take"]
    f32, i64 = np.zeros(8, np.float32), np.arange(4, dtype=np.int64)
    good = (i64, np.int64(4), f32, np.int64(8), f32, np.int32(0), np.zeros(4, np.float32))
    sources.check_launch("psparse_take", good, sig)
    bad = {"int32 array": (i64.astype(np.int32),) + good[1:],
           "7 parameters": good[:-1],
           "not contiguous": good[:2] + (np.zeros(16, np.float32)[::2],) + good[3:],
           "numpy int64 scalar": (i64, 4) + good[2:]}
    for expected, args in bad.items():
        with pytest.raises(TypeError, match=f"psparse_take: .*{expected}"):
            sources.check_launch("psparse_take", args, sig)

# ------------------------------------------------------------------------- the device
# The GPU path's kernels through a backend: emulated on the CPU always (psparse/backends/kernel_emu.py),
# on the GPU too when there is one.
def _backends():
    out = [pytest.param(lambda: EmulatedBackend(strict=True), id="emulated")]
    if cupy is not None:
        out.append(pytest.param(lambda: CudaBackend(cupy), id="cuda"))
    return out


@pytest.fixture(scope="module", params=_backends())
def dev(request):
    return request.param()


@pytest.mark.parametrize("kind", ["residual", "dgc", "scalecom", "adam"])
def test_device_memory_matches_the_cpu(dev, kind):
    cpu, device = Memory(65_537, kind), Memory(65_537, kind, dev=dev)
    rng = np.random.default_rng(4)
    for _ in range(3):
        g = rng.standard_normal(65_537).astype(np.float32)
        cpu.add(g)
        device.add(dev.upload("gradient", g))
    np.testing.assert_array_equal(dev.read(device.accumulator), cpu.accumulator)
    idx = selection.topk_reference(cpu.accumulator, 500)
    np.testing.assert_array_equal(dev.read(device.take(dev.upload("indices", idx))),
                                  cpu.take(idx))
    np.testing.assert_array_equal(dev.read(device.accumulator), cpu.accumulator)
    for name in ("velocity", "filtered", "first", "second", "powers"):
        if getattr(cpu, name, None) is not None:
            np.testing.assert_array_equal(dev.read(getattr(device, name)), getattr(cpu, name))


def test_device_clipping_scales_the_gradient_on_the_device(dev):
    g = np.random.default_rng(5).standard_normal(10_000).astype(np.float32)
    device = Memory(10_000, clip_norm=1.0, dev=dev)
    clipped = dev.read(device.clipped(dev.upload("gradient", g)))
    assert np.linalg.norm(clipped) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(clipped, g / np.linalg.norm(g.astype(np.float64)), rtol=1e-6)
    small = g / np.float32(1e4)
    np.testing.assert_array_equal(dev.read(device.clipped(dev.upload("gradient", small))), small)


def test_torch_tensors_cross_to_the_device_arrays_without_a_copy(dev):
    t = torch.zeros(8, device="cuda" if isinstance(dev, CudaBackend) else "cpu")
    a = dev.from_torch(t)
    a[3] = 5.0
    assert float(t[3]) == 5.0
    assert dev.to_torch(a).data_ptr() == t.data_ptr()


def test_device_kernels_refuse_int32_indices_by_name(dev):
    acc = dev.xp.zeros(100, dtype=np.float32)
    memory = Memory(100, dev=dev)
    with pytest.raises(TypeError, match="psparse_take: indices must be a contiguous int64"):
        memory.take(dev.upload("indices", np.arange(5, dtype=np.int32)))
    assert acc.size == 100


def test_server_device_cuda_without_a_gpu_is_a_clear_error():
    if cupy is not None:
        pytest.skip("a CUDA device is present: this checks the message on machines without one")
    from psparse.server import Server
    with pytest.raises(ValueError, match="--server-device cuda: no CUDA device"):
        Server(2, port=0, device="cuda")
