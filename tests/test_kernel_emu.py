"""The kernel emulator (psparse/backends/kernel_emu.py) is faithful where the kernels' logic needs it:
barriers really wait, warp collectives exchange values, a missing barrier or a divergent one
shows, and a write past an array's end is caught. Then every element kernel of
``sources.CUDA_SOURCE`` against its numpy formula, in both fiber orders.
"""

from __future__ import annotations

import numpy as np
import pytest

from psparse.backends.kernel_emu import EmulatedKernels, EmulatorError
from psparse.ops import sources
from psparse.ops.feedback import updates

PROBES = r"""
extern "C" __global__ void probe_block_sum(const float* x, long long n, float* out, int sync) {
    // one block: every thread writes its value, thread 0 sums them after the barrier
    __shared__ float v[256];
    v[threadIdx.x] = threadIdx.x < n ? x[threadIdx.x] : 0.0f;
    if (sync) __syncthreads();
    if (threadIdx.x == 0) { float s = 0.0f; for (int i = 0; i < 256; i++) s += v[i]; out[0] = s; }
}

extern "C" __global__ void probe_divergent(float* out, long long n) {
    if (threadIdx.x < 32) __syncthreads();   // only one warp reaches the barrier
    else { out[threadIdx.x] = 2.0f; __syncthreads(); }  // the others reach another one
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void probe_early_return(float* out, long long n) {
    if (threadIdx.x >= 32) return;   // most threads leave before the barrier
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void probe_warp(const long long* x, long long n, long long* ballot,
                                      long long* shifted) {
    // per warp: the ballot of odd values, and each lane's value from lane - 3 (itself below 3)
    long long v = x[blockIdx.x * blockDim.x + threadIdx.x];
    unsigned b = __ballot_sync(0xffffffffu, v & 1);
    long long up = __shfl_up_sync(0xffffffffu, v, 3);
    ballot[blockIdx.x * blockDim.x + threadIdx.x] = b;
    shifted[blockIdx.x * blockDim.x + threadIdx.x] = (threadIdx.x & 31) >= 3 ? up : v;
}

extern "C" __global__ void probe_past_the_end(float* out, long long n) {
    if (threadIdx.x == 0) out[n] = 1.0f;   // one element too far
}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["in-order", "reversed"])
def probes(request):
    return EmulatedKernels(PROBES, reverse=request.param)


def test_a_barrier_waits_for_every_thread(probes):
    x = np.arange(200, dtype=np.float32)
    out = np.zeros(1, np.float32)
    probes.launch("probe_block_sum", 1, 256, (x, np.int64(200), out, np.int32(1)))
    assert out[0] == x.sum()


def test_a_missing_barrier_gives_a_wrong_answer_not_a_lucky_one(probes):
    """Without the barrier, thread 0 sums shared memory the others have not written yet (in
    order) or sums before... either way the answer is wrong, every time."""
    x = np.arange(1, 201, dtype=np.float32)
    out = np.zeros(1, np.float32)
    probes.launch("probe_block_sum", 1, 256, (x, np.int64(200), out, np.int32(0)))
    if not probes.reverse:
        assert out[0] != x.sum()
    else:  # reversed: thread 0 runs last, so this probe cannot show the missing barrier
        assert out[0] == x.sum()


def test_a_divergent_barrier_is_a_deadlock_naming_the_kernel(probes):
    out = np.zeros(256, np.float32)
    with pytest.raises(EmulatorError, match="probe_divergent: deadlock in block 0: threads "
                                            "wait at different __syncthreads"):
        probes.launch("probe_divergent", 1, 256, (out, np.int64(256)))
    with pytest.raises(EmulatorError, match="probe_early_return: deadlock in block 0: 224 of "
                                            "256 threads returned"):
        probes.launch("probe_early_return", 1, 256, (out, np.int64(256)))


def test_warp_collectives_exchange_values(probes):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, 512).astype(np.int64)
    ballot, shifted = np.zeros(512, np.int64), np.zeros(512, np.int64)
    probes.launch("probe_warp", 2, 256, (x, np.int64(512), ballot, shifted))
    for w in range(16):
        lanes = x[32 * w:32 * w + 32]
        assert (ballot[32 * w:32 * w + 32] == sum(1 << i for i in range(32) if lanes[i] & 1)).all()
        want = np.concatenate([lanes[:3], lanes[:29]])
        np.testing.assert_array_equal(shifted[32 * w:32 * w + 32], want)


def test_a_write_past_the_end_is_caught_and_named(probes):
    out = np.zeros(10, np.float32)
    with pytest.raises(EmulatorError, match="probe_past_the_end: wrote 4 byte.* past the end of "
                                            "the array passed as out"):
        probes.launch("probe_past_the_end", 1, 256, (out, np.int64(10)))


def test_launches_are_checked_against_the_signature(probes):
    with pytest.raises(TypeError, match="probe_block_sum: x must be a contiguous float32"):
        probes.launch("probe_block_sum", 1, 256, (np.zeros(4), np.int64(4),
                                                  np.zeros(1, np.float32), np.int32(1)))


# ------------------------------------------------------------- the element kernels, emulated
@pytest.fixture(scope="module", params=[False, True], ids=["in-order", "reversed"])
def emu(request):
    return EmulatedKernels(sources.CUDA_SOURCE, reverse=request.param)


def _grid(n):
    return max(1, min(4, -(-n // 256)))


def test_dgc_accumulate_and_take_are_the_numpy_formulas(emu):
    rng = np.random.default_rng(1)
    n = 5003
    grad, vel, acc = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    want_vel = np.float32(0.9) * vel + grad
    want_acc = acc + want_vel
    emu.launch("psparse_dgc_accumulate", _grid(n), 256, (grad, np.float32(0.9), vel, acc,
                                                         np.int64(n)))
    np.testing.assert_array_equal(vel, want_vel)
    np.testing.assert_array_equal(acc, want_acc)
    idx = np.sort(rng.choice(n, 300, replace=False)).astype(np.int64)
    out = np.zeros(300, np.float32)
    emu.launch("psparse_take", _grid(300), 256, (idx, np.int64(300), acc, np.int64(n), vel,
                                                  np.int32(1), out))
    np.testing.assert_array_equal(out, want_acc[idx])
    assert not acc[idx].any() and not vel[idx].any()
    assert np.count_nonzero(acc) == n - 300
    # an index out of range (a policy's fault, reported by the check flags) is skipped
    bad = np.array([5, n, -1], np.int64)
    out = np.full(3, 9.0, np.float32)
    emu.launch("psparse_take", 1, 256, (bad, np.int64(3), acc, np.int64(n), vel, np.int32(1),
                                        out))
    assert out.tolist() == [want_acc[5], 0.0, 0.0]


def test_scatter_and_the_output_checks(emu):
    idx = np.array([3, 9, 10, 4000], np.int64)
    val = np.array([1.5, -0.0, 2.0, -3.0], np.float32)
    out = np.zeros(4001, np.float32)
    emu.launch("psparse_scatter", 1, 256, (idx, val, np.int64(4), out))
    assert out[3] == 1.5 and np.signbit(out[9]) and out[4000] == -3.0  # -0.0 kept, as numpy
    for bad, flags_want in [([1, 2, 3], [0, 0]), ([1, 5000], [1, 0]), ([-1, 3], [1, 0]),
                            ([4, 4], [0, 1]), ([7, 2], [0, 1])]:
        flags = np.zeros(2, np.uint64)
        a = np.array(bad, np.int64)
        emu.launch("psparse_check_indices", 1, 256, (a, np.int64(a.size), np.int64(4001), flags))
        assert flags.tolist() == flags_want, bad


def test_the_decayed_state_kernels_follow_decaying(emu):
    """decay, renormalise, add and the per-slice maxima against updates.Decaying itself."""
    rng = np.random.default_rng(2)
    n, bounds = 3000, np.array([0, 1000, 1001, 3000], np.int64)
    host = updates.Decaying(n)
    host.RENORMALISE_BELOW = 0.3  # renormalise every few rounds
    stored = np.zeros(n, np.float32)
    scale, flag, top = np.ones(1), np.zeros(1, np.int32), np.zeros(3, np.float32)
    for it in range(12):
        idx = np.sort(rng.choice(n, 200, replace=False)).astype(np.int64)
        val = (rng.standard_normal(200) * 10.0 ** rng.integers(-30, 3)).astype(np.float32)
        host.decay(0.5)
        emu.launch("psparse_decay", 1, 256, (scale, np.float64(0.5), np.float64(0.3), flag, top,
                                             np.int64(3)))
        emu.launch("psparse_renormalise", _grid(n), 256, (stored, np.int64(n), scale, flag))
        emu.launch("psparse_segment_max", 3, 256, (stored, bounds, np.int64(3), top, flag))
        emu.launch("psparse_renormalised", 1, 256, (scale, flag))
        host.add(idx, val, 0.5)
        emu.launch("psparse_decaying_add", 1, 256, (idx, val, np.int64(200), np.float64(0.5),
                                                    np.int32(0), scale, stored, bounds,
                                                    np.int64(3), top, np.int32(1)))
        np.testing.assert_array_equal(stored, host.stored, err_msg=f"round {it}")
        assert scale[0] == host.scale
        for s in range(3):  # the maxima track what was added since the last renormalisation
            assert top[s] <= host.stored[bounds[s]:bounds[s + 1]].max()
    ones = np.ones(1, np.int32)
    emu.launch("psparse_segment_max", 3, 256, (stored, bounds, np.int64(3), top, ones))
    np.testing.assert_array_equal(top, [host.stored[bounds[s]:bounds[s + 1]].max()
                                        for s in range(3)])


def test_mark_sets_the_selected_indices_of_each_segment(emu):
    # two segments: output bases 0 and 5, of which 3 and 2 were selected
    segs = np.zeros((2, 10), np.int64)
    segs[:, 5] = [0, 5]
    report = np.array([3, 0, 2, 0], np.int64)
    indices = np.array([1, 4, 7, 99, 99, 20, 22, 99, 99], np.int64)
    mask = np.zeros(30, np.uint8)
    emu.launch("psparse_mark", 2, 256, (indices, segs, report, np.int64(2), mask, np.int32(1)))
    assert np.flatnonzero(mask).tolist() == [1, 4, 7, 20, 22]
