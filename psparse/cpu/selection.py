"""Kernels: accumulation, top-k selection, policy state updates and sparse aggregation.

Two kinds of code live here. The host path's numpy kernels (top-k by a sampled threshold and a
blockwise compaction, error feedback, the lazily decayed policy state, the server's sparse
mean), each the reference the compiled kernels are tested against. And ``CUDA_SOURCE``, the
GPU path's element kernels (error feedback, gather-and-zero, the aggregate's scatter, the
output checks, the decayed state with its scale on the device), launched through a backend
(``psparse.backend``); the GPU's selection is ``psparse.radix``'s engine:

=====================  ==================================  ===================================
step                   numpy (host, the reference)         CUDA (psparse.backend launches)
=====================  ==================================  ===================================
DGC accumulate         v *= m; v += g; acc += v            one fused pass (or fused into the
                                                           selection's first pass: radix)
top-k                  sampled threshold, compaction, trim  radix select (psparse/radix.py)
take                   acc[idx] (copy); acc[idx] = 0        one gather-and-zero (or fused into
                                                           the selection's last pass)
EMA / count update     lazy: scale *= beta on the host,     the same, the scale a device double
(``Decaying``)         one numpy.add.at over k entries      (``device_policy.DeviceDecaying``)
sparse mean            np.add.at + sort/dedup               (server) cupy.add.at + sort/dedup
=====================  ==================================  ===================================

Top-k order (both devices, so CPU and GPU workers pick identical sets): larger |x| first, ties
by lower index. Non-finite accumulators are refused with ``NonFiniteError`` (a NaN can never be
"large", so selecting around it would hide a diverged run). The CUDA kernels avoid fused
multiply-add where numpy rounds twice, so GPU policy state is bit-identical to the host's.
"""

from __future__ import annotations

import re

import numpy as np

from . import jit
from .xp import array_module

select_kernels = jit.LazyModule("psparse.select_kernels")

SAMPLE_STRIDE = 97  # prime stride: ~1% sample, no aliasing with layer shapes (powers of two)
MARGIN = 1.25  # aim for 25% more candidates than k, so an unlucky sample rarely falls short
SCATTER_CHUNK = 1 << 14  # entries read, added and written back at a time (their lines stay in L2)


class NonFiniteError(ValueError):
    """The accumulator holds NaN or infinity (the run diverged)."""


# ------------------------------------------------------------------------------- reference
def topk_reference(x, k: int):
    """Sorted indices of the k largest |x|, ties to the lower index. O(n log n); tests only."""
    xp = array_module(x)
    k = max(0, min(k, x.size))
    order = xp.lexsort(xp.stack([xp.arange(x.size, dtype=xp.float64),
                                 -xp.abs(x).astype(xp.float64)]))
    return xp.sort(order[:k]).astype(xp.int64)


# ------------------------------------------------------------------------------- selection
def estimate_threshold(x, k: int) -> float:
    """A magnitude that about MARGIN * k entries of x reach, from a strided ~1% sample."""
    return sample_threshold(array_module(x).abs(x[::SAMPLE_STRIDE]), k, x.size)


def sample_threshold(sample, k: int, n: int) -> float:
    """The magnitude about MARGIN * k of n entries reach, from the magnitudes of ``sample``,
    every SAMPLE_STRIDE-th of them."""
    xp = array_module(sample)
    # expected = how many of the sample the top k hold; its noise is ~sqrt(expected), so aim
    # 3 of those above it when that beats MARGIN (a top-k of ~1,400 of 11M, e.g. core's own
    # slice, has ~14 samples: MARGIN alone fell short 6 rounds in 40, and each costs a pass)
    expected = k * sample.size / n
    want = max(expected * MARGIN, expected + 3 * np.sqrt(expected))
    want = min(sample.size, max(1, int(np.ceil(want)) + 1))
    return float(xp.partition(sample, sample.size - want)[sample.size - want])


def trim(indices, values, k: int):
    """The k of the candidates (index, value) with largest |value|, ties to the lower index;
    returned as sorted indices and their values. O(candidates): one partition, two compares."""
    xp = array_module(values)
    if indices.size <= k:
        return indices, values
    mag = xp.abs(values)
    kth = xp.partition(mag, mag.size - k)[mag.size - k]  # the k-th largest magnitude
    keep = mag > kth
    short = k - int(xp.count_nonzero(keep))
    keep[xp.flatnonzero(mag == kth)[:short]] = True  # ties: the lowest indices
    return indices[keep], values[keep]


def exact_threshold(x, k: int) -> float:
    """The k-th largest |x| (every entry at or above it is a candidate)."""
    xp = array_module(x)
    mag = xp.abs(x)
    return float(xp.partition(mag, x.size - k)[x.size - k])


def select(x, k: int, compact):
    """Sorted indices of the k largest |x| (exact, ties to the lower index), and their values.

    ``compact(x, threshold, capacity)`` returns (indices, values, count): entries with
    |x| >= threshold, at most ``capacity`` of them, and how many there were in all. One sampled
    threshold, one compaction pass, a trim of ~1.25 k candidates; when the sample misjudged
    (too few, or more than the buffer holds) the exact k-th magnitude is used instead.
    """
    xp = array_module(x)
    n = x.size
    k = max(0, min(k, n))
    if k == 0:
        return xp.empty(0, xp.int64), xp.empty(0, x.dtype)
    capacity = 2 * k + 1024
    threshold = estimate_threshold(x, k) if k < n else 0.0
    idx, val, count = compact(x, threshold, capacity)
    if count < k or count > capacity:
        threshold = exact_threshold(x, k)
        idx, val, count = compact(x, threshold, capacity)
        if count > capacity:  # many ties at the k-th magnitude (e.g. zeros): room for all
            idx, val, count = compact(x, threshold, count)
    return trim(idx, val, k)


def compact_numpy(x: np.ndarray, threshold: float, capacity: int, block: int = 1 << 16,
                  scratch: np.ndarray | None = None):
    """CPU compaction: |x| >= threshold block by block, so the |x| scratch stays in cache."""
    parts = []
    mag_buf = scratch if scratch is not None else np.empty(min(block, x.size), np.float32)
    for start in range(0, x.size, block):
        chunk = x[start:start + block]
        mag = mag_buf[:chunk.size]
        np.abs(chunk, out=mag)
        if not np.isfinite(mag.max()):  # in cache; NaN and inf propagate through max
            raise NonFiniteError(f"the accumulator holds NaN or inf (first near index {start})")
        hits = np.flatnonzero(mag >= threshold)
        if hits.size:
            parts.append(hits + start)
    idx = np.concatenate(parts) if parts else np.empty(0, np.int64)
    count = idx.size
    idx = idx[:capacity]
    return idx, x[idx], count


def compact_scored(score, n: int, threshold: float, capacity: int, scratch: np.ndarray):
    """``compact_numpy`` of a score that is never written whole: ``score(sl, out)`` writes
    score[sl] into out, one block of ``scratch``'s size at a time, selected while in cache."""
    parts, values = [], []
    for start in range(0, n, scratch.size):
        block = scratch[:min(scratch.size, n - start)]
        score(slice(start, start + block.size), block)
        if not np.isfinite(block.max()):  # non-negative: NaN and inf propagate through max
            raise NonFiniteError(f"the score holds NaN or inf (first near index {start})")
        hits = np.flatnonzero(block >= threshold)
        if hits.size:
            parts.append(hits + start)
            values.append(block[hits])
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.float32), 0
    idx, val = np.concatenate(parts), np.concatenate(values)
    return idx[:capacity], val[:capacity], idx.size


def at_least(x, threshold: float, scratch=None):
    """Sorted indices of the entries with |x| >= threshold (on the host block by block, so the
    |x| scratch stays in cache and no n-sized array is made; NaN is never selected)."""
    xp = array_module(x)
    if xp is not np or scratch is None:
        return xp.flatnonzero(xp.abs(x) >= threshold)
    parts = []
    for start in range(0, x.size, scratch.size):
        chunk = x[start:start + scratch.size]
        mag = np.abs(chunk, out=scratch[:chunk.size])
        hits = np.flatnonzero(mag >= threshold)
        if hits.size:
            parts.append(hits + start)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def select_any(x, k: int):
    """``select`` on the host, with the blockwise compaction (the GPU's selection is the radix
    engine: psparse.radix)."""
    return select(x, k, compact_numpy)


# -------------------------------------------------------------------------- error feedback
def accumulate(acc, grad, velocity=None, momentum: float = 0.0):
    """acc += grad; or DGC momentum correction: velocity = m * velocity + grad; acc += velocity.

    In place; returns acc.
    """
    if velocity is None:
        acc += grad
    else:
        velocity *= np.float32(momentum)
        velocity += grad
        acc += velocity
    return acc


def take(acc, indices, velocity=None):
    """The values of acc at ``indices`` (a copy), then zero acc (and velocity) there."""
    values = acc[indices]
    acc[indices] = 0.0
    if velocity is not None:
        velocity[indices] = 0.0
    return values


# -------------------------------------------------------------------------- policy state
def decay_and_add(priority, indices, values, decay: float, weight: float,
                  magnitude: bool = True, out=None):
    """priority *= decay; priority[indices] += weight * (|values| or values).

    ``out`` (optional, indices.size floats) receives the updated values at ``indices``.
    (The built-in policies keep their state in a ``Decaying`` vector, which decays lazily.)
    """
    priority *= np.float32(decay)
    scatter_add(priority, indices, values, weight, magnitude, out)
    return priority


def decay_and_count(priority, indices, decay: float):
    """priority *= decay; priority[indices] += 1 (frequency counts)."""
    priority *= np.float32(decay)
    scatter_add(priority, indices, None, 1.0)
    return priority


def scatter_add(target, indices, values, weight: float, magnitude: bool = True,
                out=None) -> None:
    """target[indices] += weight * (|values| or values); ``values`` None: += weight. ``out``
    (optional, indices.size floats) receives the updated values.

    The aggregate's indices are distinct, so the scatter needs no atomics (on the host,
    ``numpy.add.at``'s fast path: 1.5-2x faster than ``target[indices] += ...``, the same
    sums). With
    ``out`` the host reads, adds and writes back SCATTER_CHUNK entries at a time, so each
    entry's cache line is fetched once (add.at and then a gather fetched it twice: a model-sized
    target is not in cache, and the aggregate touches a line per entry).
    """
    if not indices.size:
        return
    add = np.float32(weight) if values is None else \
        np.float32(weight) * (np.abs(values) if magnitude else values)
    if out is None:
        np.add.at(target, indices, add)
        return
    for start in range(0, indices.size, SCATTER_CHUNK):
        part = slice(start, start + SCATTER_CHUNK)
        # mode="clip": the indices are in range, and the default "raise" buffers ``out``
        updated = np.take(target, indices[part], out=out[part], mode="clip")
        updated += add if values is None else add[part]
        target[indices[part]] = updated


class Decaying:
    """A float32 vector that decays by a factor every round and grows at the aggregate's
    indices (the EMA and count state of ``core``, ``ema`` and ``frequency``), kept lazily as

        value = scale * stored     (scale: a host float, the product of the decays so far)

    so a round costs O(aggregate), not a pass over the model: ``decay`` multiplies ``scale``,
    ``add`` scatters weight / scale. Rankings by value are rankings by ``stored`` (one positive
    factor), which is what the policies read. Renormalising (stored *= scale, scale = 1) once
    scale falls below RENORMALISE_BELOW keeps ``stored`` in range (at most 2^64 times the
    largest value added) and flushes every value below float32's smallest normal to zero.

    Against decaying every entry every round (``decay_and_add``): the same values up to float
    rounding (each is rounded once per add, not once per round; for a power-of-two decay, e.g.
    core's beta = 0.5, bit-identical while values are normal), and values that decayed below
    1.2e-38 are 0 from the next renormalisation on, where the eager update kept subnormals (each
    ~30 ns to multiply, on x86) until they underflowed. Deterministic and built from the
    aggregate alone: identical on every worker. ``state_dict`` holds ``stored`` and ``scale``,
    so a restored vector continues bit-identically.
    """

    RENORMALISE_BELOW = 2.0 ** -64

    def __init__(self, n: int, xp=np):
        self.xp = xp
        self.stored = xp.zeros(n, dtype=xp.float32)
        self.scale = 1.0

    def decay(self, factor: float) -> bool:
        """value *= factor. Returns True when ``stored`` was renormalised (rescaled)."""
        self.scale *= factor
        if self.scale >= self.RENORMALISE_BELOW:
            return False
        self.renormalise()
        return True

    def renormalise(self) -> None:
        """stored *= scale, scale = 1 (the same values); what falls below float32's smallest
        normal becomes 0. A pass over the vector."""
        stored = self.stored
        if jit.host_compiled(stored):  # one compiled pass
            select_kernels.renormalise(stored, np.float32(self.scale))
        else:
            stored *= np.float32(self.scale)
            stored[self.xp.abs(stored) < np.finfo(np.float32).tiny] = 0.0
        self.scale = 1.0

    def add(self, indices, values, weight: float, magnitude: bool = True, out=None) -> None:
        """value[indices] += weight * (|values| or values); ``values`` None: += weight.
        ``out`` (optional, indices.size floats) receives the updated stored values. numpy
        (``scatter_add``): ``add_compiled``, measured back to back in ema's and frequency's
        observe at 11M, was faster at 1% (6.4 against 6.8 ms) but slower at 0.1% (1.46 against
        1.10, 1.04 against 0.85); core, faster at both, calls ``add_compiled`` itself."""
        scatter_add(self.stored, indices, values, weight / self.scale, magnitude, out)

    def add_compiled(self, indices, values, weight: float, magnitude: bool = True, out=None,
                     old=None, tops=None, edges=None) -> None:
        """``add`` on the host, compiled (``select_kernels.scatter_add``: the same sums); also
        the stored values before the add into ``old`` and, per slice [edges[s], edges[s+1]),
        the largest updated value into ``tops[s]`` (kept if larger), when given."""
        n = indices.size
        out = np.empty(n, np.float32) if out is None else out
        old = np.empty(n, np.float32) if old is None else old
        mode = 2 if values is None else 0 if magnitude else 1
        values = select_kernels.NO_AUX if values is None else np.ascontiguousarray(values)
        select_kernels.scatter_add(
            self.stored, np.ascontiguousarray(indices), values, np.float32(weight / self.scale),
            mode, old, out, select_kernels.NO_MARKS if edges is None else edges,
            select_kernels.NO_AUX if tops is None else tops)

    def values(self):
        """The values themselves (a new array; for inspection and tests)."""
        return self.stored * np.float32(self.scale)

    def state_dict(self) -> dict:
        return {"priority": self.stored, "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """A ``state_dict``; or, from a checkpoint of the eager update, the values alone."""
        self.stored[...] = self.xp.asarray(state["priority"])
        self.scale = float(state.get("scale", 1.0))


def slice_bounds(indices, slices) -> list[tuple[int, int]]:
    """For sorted global ``indices`` and slices [(offset, size), ...] in order: per slice, the
    (lo, hi) such that indices[lo:hi] are the slice's."""
    if len(slices) == 1:
        return [(0, indices.size)]
    xp = array_module(indices)
    edges = [offset for offset, _ in slices] + [slices[-1][0] + slices[-1][1]]
    bounds = xp.searchsorted(indices, xp.asarray(edges, dtype=indices.dtype)).tolist()
    return list(zip(bounds, bounds[1:]))


def sorted_union(indices: list):
    """Sorted distinct values of several index arrays (sort, then drop repeats).

    ``numpy.unique`` (numpy 2.x) is ~50x slower than this on 10^6 ints. Two sorted arrays (a
    policy's candidates and an aggregate) are merged by numpy's stable sort, which finds the two
    runs (2-4x faster than quicksort there; slower from about eight runs on).
    """
    xp = array_module(indices[0])
    merged = xp.concatenate(indices)
    if xp is np and len(indices) == 2:
        merged.sort(kind="stable")
    else:
        merged = xp.sort(merged)
    if merged.size < 2:
        return merged
    keep = xp.empty(merged.size, dtype=bool)
    keep[0] = True
    xp.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]


# ------------------------------------------------------------------------------ CUDA code
# The GPU path's element kernels, one CUDA C source that CuPy compiles once per process (and
# caches on disk); the selection engine's is psparse/radix.cu. They are plain
# __global__ functions rather than ElementwiseKernels so that the whole of what the package can
# launch is these texts: `make check-kernels` compiles them with NVRTC on machines without a GPU
# (psparse/kernel_check.py), psparse/kernel_emu.py runs them on the CPU for the tests. Indices
# the kernels take are int64 (long long): received int32 indices are widened once, as they are
# uploaded. Most are grid-stride loops over n elements (a backend's ``launch_over``); the
# decayed state's decisions run on one thread. Float maths uses the _rn intrinsics so the
# compiler cannot fuse a multiply and an add (numpy rounds after each).
CUDA_SOURCE = r"""
extern "C" __global__ void psparse_dgc_accumulate(const float* grad, float momentum,
                                                  float* velocity, float* acc, long long n) {
    // DGC momentum correction: velocity = m * velocity + grad; acc += velocity (one pass)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float u = __fadd_rn(__fmul_rn(momentum, velocity[j]), grad[j]);
        velocity[j] = u;
        acc[j] = __fadd_rn(acc[j], u);
    }
}

extern "C" __global__ void psparse_take(const long long* indices, long long n, float* acc,
                                        long long numel, float* velocity, int has_velocity,
                                        float* out) {
    // gather the values sent and zero the accumulator (and DGC velocity, if any) there; an
    // index out of [0, numel) (a policy's fault, refused once the check flags are read) is
    // skipped, so the fault is reported instead of corrupting memory
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        if (at < 0 || at >= numel) { out[j] = 0.0f; continue; }
        out[j] = acc[at];
        acc[at] = 0.0f;
        if (has_velocity) velocity[at] = 0.0f;
    }
}

extern "C" __global__ void psparse_scatter(const long long* indices, const float* values,
                                           long long n, float* out) {
    // out[indices] = values (the aggregate into the zeroed gradient; indices distinct)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[indices[j]] = values[j];
}

extern "C" __global__ void psparse_check_indices(const long long* indices, long long n,
                                                 long long numel, unsigned long long* flags) {
    // a policy's output on the device: flags[0] |= out of [0, numel), flags[1] |= not strictly
    // increasing (read back with the round's copy, so no check waits for the device)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long v = indices[j];
        if (v < 0 || v >= numel) atomicOr(&flags[0], 1ULL);
        if (j > 0 && indices[j - 1] >= v) atomicOr(&flags[1], 1ULL);
    }
}

// ---- a lazily decayed vector (kernels.Decaying) with its scale on the device ----------------
// state = [scale] (double), flag = [renormalise this round]; the decisions are taken here, so
// the host never reads the scale
extern "C" __global__ void psparse_decay(double* scale, double factor, double below, int* flag,
                                         float* top, long long nseg) {
    // scale *= factor; a renormalisation is due once it falls below `below` (then the
    // per-segment maxima, if tracked, are recomputed: cleared here)
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = __dmul_rn(scale[0], factor);
    scale[0] = s;
    flag[0] = s < below;
    if (flag[0]) for (long long i = 0; i < nseg; i++) top[i] = 0.0f;
}

extern "C" __global__ void psparse_limit_check(const float* top, long long nseg, double limit,
                                               const double* scale, int* flag, float* topw) {
    // ema: renormalise when the largest stored priority passes `limit` while scale < 1
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float m = 0.0f;
    for (long long i = 0; i < nseg; i++) m = top[i] > m ? top[i] : m;
    flag[0] = (double)m > limit && scale[0] < 1.0;
    if (flag[0]) for (long long i = 0; i < nseg; i++) topw[i] = 0.0f;
}

extern "C" __global__ void psparse_renormalise(float* stored, long long n, const double* scale,
                                               const int* flag) {
    // when flagged: stored *= scale (as float32), values below float32's smallest normal -> 0
    if (!flag[0]) return;
    float s = (float)scale[0];
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float v = __fmul_rn(stored[j], s);
        stored[j] = fabsf(v) < 1.17549435e-38f ? 0.0f : v;
    }
}

extern "C" __global__ void psparse_segment_max(const float* stored, const long long* bounds,
                                               long long nseg, float* top, const int* flag) {
    // when flagged: top[s] = max of stored over segment s = [bounds[s], bounds[s + 1]), one
    // block per segment (values are >= 0: their bits order as they do)
    __shared__ float best[256];
    if (!flag[0]) return;
    for (long long s = blockIdx.x; s < nseg; s += gridDim.x) {
        float m = 0.0f;
        for (long long j = bounds[s] + threadIdx.x; j < bounds[s + 1]; j += blockDim.x)
            m = stored[j] > m ? stored[j] : m;
        best[threadIdx.x] = m;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w >>= 1) {
            if ((int)threadIdx.x < w && best[threadIdx.x + w] > best[threadIdx.x])
                best[threadIdx.x] = best[threadIdx.x + w];
            __syncthreads();
        }
        if (threadIdx.x == 0) top[s] = best[0];
        __syncthreads();
    }
}

extern "C" __global__ void psparse_renormalised(double* scale, int* flag) {
    // after a flagged renormalisation: scale = 1 and the flag cleared
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (flag[0]) { scale[0] = 1.0; flag[0] = 0; }
}

extern "C" __global__ void psparse_decaying_add(const long long* indices, const float* values,
                                                long long n, double weight, int kind,
                                                const double* scale, float* stored,
                                                const long long* bounds, long long nseg,
                                                float* top, int track_max) {
    // stored[indices] += (weight / scale) * (|values| for kind 0, values for 1, 1 for 2),
    // rounded as numpy does (the float32 factor, then the product, then the sum); with
    // track_max the per-segment maxima grow to the updated values (indices sorted, distinct)
    float w = (float)__ddiv_rn(weight, scale[0]);
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        float add = kind == 2 ? w : __fmul_rn(w, kind == 0 ? fabsf(values[j]) : values[j]);
        float v = __fadd_rn(stored[at], add);
        stored[at] = v;
        if (track_max) {
            long long lo = 0, hi = nseg;  // the segment holding `at`
            while (hi - lo > 1) { long long mid = (lo + hi) / 2; if (bounds[mid] <= at) lo = mid; else hi = mid; }
            atomicMax((unsigned int*)&top[lo], __float_as_uint(v));
        }
    }
}

extern "C" __global__ void psparse_push_add(const long long* indices, const float* values,
                                            long long n, float* sum, unsigned char* touched) {
    // the server's sum, one push at a time in rank order: sum[indices] += values, touched = 1
    // (a push's indices are distinct: no atomics, and the order of additions is the host's)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        sum[at] = __fadd_rn(sum[at], values[j]);
        touched[at] = 1;
    }
}

extern "C" __global__ void psparse_dense_add(const float* values, long long n, float* sum,
                                             unsigned char* touched) {
    // a dense push: every entry
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        sum[j] = __fadd_rn(sum[j], values[j]);
        touched[j] = 1;
    }
}

extern "C" __global__ void psparse_divide(float* values, const long long* report, float by) {
    // values[:report[0]] /= by (the mean of the union's sums; report: a radix select's)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < report[0];
         j += stride)
        values[j] = __fdiv_rn(values[j], by);
}

extern "C" __global__ void psparse_mark(const long long* indices, const long long* segs,
                                        const long long* report, long long nseg,
                                        unsigned char* mask, int value) {
    // mask[i] = value for each segment's selected indices of a radix select (psparse/radix.py:
    // segs[s * 10 + 5] is its output base, report[s * 2] how many it selected); every block
    // takes its share of every segment (grid-stride), so a long one is not one block's work
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long s = 0; s < nseg; s++) {
        long long base = segs[s * 10 + 5], count = report[s * 2];
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
             j += stride)
            mask[indices[base + j]] = (unsigned char)value;
    }
}
"""

# C parameter type -> (array or scalar, dtype) that a launch must pass for it
C_TYPES = {
    "const float*": ("array", np.float32), "float*": ("array", np.float32),
    "const long long*": ("array", np.int64), "long long*": ("array", np.int64),
    "unsigned long long*": ("array", np.uint64), "const unsigned long long*": ("array", np.uint64),
    "unsigned int*": ("array", np.uint32), "const unsigned char*": ("array", np.uint8),
    "unsigned char*": ("array", np.uint8), "int*": ("array", np.int32),
    "const int*": ("array", np.int32), "double": ("scalar", np.float64),
    "double*": ("array", np.float64), "const double*": ("array", np.float64),
    "long long": ("scalar", np.int64), "float": ("scalar", np.float32), "int": ("scalar", np.int32),
}
_KERNEL_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')


def kernel_signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel name: [(C type, parameter name), ...]} of every kernel in a CUDA C source."""
    signatures = {}
    for name, params in _KERNEL_SIGNATURE.findall(source):
        pairs = []
        for param in params.split(","):
            ctype, _, pname = " ".join(param.split()).replace(" *", "* ").rpartition(" ")
            pairs.append((ctype.strip(), pname))
        signatures[name] = pairs
    return signatures


CUDA_KERNELS = kernel_signatures(CUDA_SOURCE)


def check_launch(name: str, args: tuple, signature: list[tuple[str, str]]) -> None:
    """Arguments against the kernel's C signature: a launch with a wrong count, dtype or a
    non-contiguous array would read memory as the wrong type; this makes it a clear error."""
    if len(args) != len(signature):
        raise TypeError(f"{name}: {len(args)} arguments for {len(signature)} parameters "
                        f"({', '.join(p for _, p in signature)})")
    for arg, (ctype, pname) in zip(args, signature):
        kind, dtype = C_TYPES[ctype]
        is_array = hasattr(arg, "shape") and not isinstance(arg, np.generic)
        if kind == "array" and not (is_array and arg.dtype == dtype and arg.flags.c_contiguous):
            got = f"{arg.dtype} array" + ("" if arg.flags.c_contiguous else ", not contiguous") \
                if is_array else type(arg).__name__
            raise TypeError(f"{name}: {pname} must be a contiguous {np.dtype(dtype)} array "
                            f"({ctype}), got {got}")
        if kind == "scalar" and not (isinstance(arg, np.generic) and arg.dtype == dtype):
            raise TypeError(f"{name}: {pname} must be a numpy {np.dtype(dtype)} scalar ({ctype}), "
                            f"got {type(arg).__name__}")


def build_cupy_kernels(cupy, source: str = CUDA_SOURCE, names=tuple(CUDA_KERNELS)) -> dict:
    """CuPy kernel objects for ``names`` in ``source``; constructing one compiles nothing (the
    first launch does, and CuPy caches the binary on disk by source, so all four share it)."""
    return {name: cupy.RawKernel(source, name) for name in names}
