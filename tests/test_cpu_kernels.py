"""Every compiled CPU kernel (psparse/ops/aggregate/agg_kernels.py, psparse/ops/codec/codec_kernels.py) equals its
numpy reference (codec_reference.py in its psparse/ops/ folder) bit for bit, on random and adversarial inputs, and the
kernels load from numba's cache in the processes the runs start instead of compiling again."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psparse.ops import jit
from psparse.ops.aggregate import reference as aggregate_reference
from psparse.ops.codec import codec
from psparse.ops.codec import reference as codec_reference
from psparse.ops.codec.codec import CodecError
from psparse.ops.select.selection import NonFiniteError
from psparse.ops.select.sparsify import topk_exact
from psparse.server.aggregation import Aggregator, ServerLimit, top_k
from psparse.wire import protocol
from psparse.worker.frames import global_indices, merge_aggregates

HYPOTHESIS = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes: -0.0 differs from 0.0, as it does on the wire."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def oracle_mean(numel, indices, values):
    with np.errstate(over="ignore"):  # sums of values near float32's largest reach inf
        return aggregate_reference.sparse_mean(np.zeros(numel, np.float32),
                                     [np.arange(numel) if i is None else i for i in indices],
                                     values)


def check_mean(numel, indices, values):
    agg = Aggregator(numel)
    union, mean = agg.mean(indices, values)
    ref_union, ref_mean = oracle_mean(numel, indices, values)
    # the union in the model's natural index dtype; int64 with a dense push, or none at all
    natural = np.int64 if not indices or any(i is None for i in indices) else agg.index_dtype
    assert np.array_equal(union, ref_union) and union.dtype == natural
    assert same_bits(mean, ref_mean)
    assert not agg._bits.any() and not agg.accumulator.any()
    return union, mean


def random_pushes(rng, numel, n, k, dtype, shared=0.5):
    common = rng.choice(numel, int(k * shared), replace=False)
    pushes = []
    for _ in range(n):
        own = rng.choice(numel, k, replace=False)
        pushes.append(np.unique(np.concatenate([common, own]))[:k].astype(dtype))
    return pushes, [rng.standard_normal(p.size).astype(np.float32) for p in pushes]


# ------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("numel, n, k", [(50, 3, 10), (61_706, 8, 617), (2_000_000, 8, 20_000),
                                         (2_000_000, 16, 2_000), (300_000, 2, 150_000)])
def test_mean_equals_the_reference_on_random_pushes(numel, n, k, dtype):
    rng = np.random.default_rng(numel + n)
    check_mean(numel, *random_pushes(rng, numel, n, k, dtype))


def test_mean_adversarial_inputs():
    i32 = np.int32
    empty = np.empty(0, i32)
    cases = [
        (10, [], []),  # no pushes
        (10, [empty, empty], [np.empty(0, np.float32)] * 2),  # nothing pushed
        (10, [np.array([9], i32)], [np.array([-0.0], np.float32)]),  # one entry, -0.0
        (10, [np.array([3, 4], i32)] * 4, [np.array([-0.0, 1e-45], np.float32)] * 4),
        (12, [np.array([0, 1], i32), np.array([5, 6], i32), np.array([10, 11], i32)],  # disjoint
         [np.ones(2, np.float32)] * 3),
        (4, [np.array([2], i32)] * 3, [np.array([v], np.float32) for v in (1e8, 1.0, -1e8)]),
        (3000, [np.array([2999], np.int64)], [np.array([7.0], np.float32)]),  # int64
        (100, [np.array([1, 50], i32), np.array([50, 99], np.int64)],  # mixed dtypes
         [np.array([1, 2], np.float32), np.array([3, 4], np.float32)]),
    ]
    for numel, indices, values in cases:
        check_mean(numel, indices, values)


def float32_sums(indices, values):
    """Rank-order float32 sums per index, one entry at a time: the reference without a
    model-sized vector (for indices near 2**31 and beyond)."""
    sums = {}
    for idx, val in zip(indices, values):
        for i, v in zip(idx.tolist(), val):
            sums[i] = np.float32(sums.get(i, np.float32(0.0)) + v)
    union = sorted(sums)
    return union, np.array([sums[i] for i in union], np.float32) / np.float32(len(values))


@pytest.mark.parametrize("numel, dtype", [(2**31 - 1, np.int32), (2**40, np.int64)])
def test_mean_at_the_largest_indices(numel, dtype):
    top = numel - 1
    indices = [np.array([0, top - 70_000, top], dtype), np.array([top - 1, top], dtype)]
    values = [np.array([1.5, -0.0, 2.5], np.float32), np.array([-0.0, 3.0e38], np.float32)]
    union, mean = Aggregator(numel).mean(indices, values)
    want_union, want_mean = float32_sums(indices, values)
    assert union.tolist() == want_union and union.dtype == protocol.index_dtype_for(numel)
    assert same_bits(mean, want_mean)


def test_every_block_size_agrees(monkeypatch):
    from psparse.ops.aggregate import agg_kernels
    rng = np.random.default_rng(3)
    pushes = random_pushes(rng, 1_000_000, 5, 30_000, np.int32)
    for bits in (agg_kernels.MIN_BLOCK_BITS, 15, 18, agg_kernels.MAX_BLOCK_BITS):
        monkeypatch.setattr(agg_kernels, "block_bits_for", lambda *a, b=bits: b)
        check_mean(1_000_000, *pushes)


def test_a_dense_push_among_sparse_ones():
    rng = np.random.default_rng(1)
    numel = 5000
    sparse, values = random_pushes(rng, numel, 3, 400, np.int32)
    check_mean(numel, [sparse[0], None, sparse[1]],
               [values[0], rng.standard_normal(numel).astype(np.float32), values[1]])


@st.composite
def pushes_strategy(draw):
    numel = draw(st.integers(1, 300))
    n = draw(st.integers(1, 6))
    floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    indices, values = [], []
    for _ in range(n):
        chosen = sorted(draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
        indices.append(np.array(chosen, dtype))
        values.append(np.array(draw(st.lists(floats, min_size=len(chosen),
                                             max_size=len(chosen))), np.float32))
    return numel, indices, values


@HYPOTHESIS
@given(pushes_strategy())
def test_mean_property(case):
    check_mean(*case)


@HYPOTHESIS
@given(pushes_strategy(), st.integers(0, 400))
def test_vote_candidates_property(case, keep):
    numel, indices, values = case
    try:
        with np.errstate(over="ignore"):
            want = aggregate_reference.candidates(np.zeros(numel, np.float32), indices, values, keep)
    except NonFiniteError:
        want = None
    try:
        got = Aggregator(numel).candidates(indices, values, keep)
    except NonFiniteError:
        assert want is None  # a mean |value| overflowed to inf: both refuse
        return
    if want is None:
        # the one intentional difference: the reference tests a float32 sum of every score,
        # which overflows for finite scores near float32's largest; the kernel tests each score
        _, scores = oracle_mean(numel, indices, [np.abs(v) for v in values])
        assert np.isfinite(scores).all() and not np.isfinite(scores.sum())
        return
    assert np.array_equal(got[0], want[0]) and same_bits(got[1], want[1]) and got[2] == want[2]


def test_top_k_equals_topk_exact_with_ties_and_refuses_non_finite():
    rng = np.random.default_rng(5)
    for n in (1, 2, 10, 1000, 70_000):
        for x in (rng.standard_normal(n).astype(np.float32),
                  rng.integers(-3, 4, n).astype(np.float32),  # many ties, zeros, -0.0
                  np.zeros(n, np.float32)):
            for k in {0, 1, n // 3, n - 1, n, n + 5}:
                assert np.array_equal(top_k(x, k), topk_exact(x, k))
                mag = np.abs(x)
                assert np.array_equal(top_k(mag, k, nonnegative=True),
                                      topk_exact(mag, k, nonnegative=True))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.arange(10, dtype=np.float32)
        x[4] = bad
        with pytest.raises(NonFiniteError):
            top_k(x, 3)
        with pytest.raises(NonFiniteError):
            topk_exact(x, 3)


def test_server_limit_equals_the_reference_over_rounds():
    rng = np.random.default_rng(7)
    numel = 20_000
    for limit in (1, 50, 700, 5000):
        ours, ref = ServerLimit(numel, (1.0, "entries")), ServerLimit(numel, (1.0, "entries"))
        for _ in range(12):
            k = int(rng.integers(0, 1500))
            union = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
            mean = rng.integers(-4, 5, k).astype(np.float32) / np.float32(3)  # ties, zeros
            got = ours.apply(union, mean, limit)
            want = aggregate_reference.limit_apply(ref, union, mean, limit)
            assert np.array_equal(got[0], want[0]) and same_bits(got[1], want[1])
            assert np.array_equal(ours.support, ref.support)
            assert same_bits(ours.residual, ref.residual)


def test_shard_merge_and_split_equal_the_reference():
    rng = np.random.default_rng(9)
    edges = np.array([0, 1000, 2500, 4000], np.int64)
    parts = [(np.sort(rng.choice(int(b - a), 50, replace=False)).astype(np.int32),
              rng.standard_normal(50).astype(np.float32)) for a, b in zip(edges, edges[1:])]
    msgs = [protocol.Message("aggregate", {"workers": 2, "count": 50}, i, v) for i, v in parts]
    merged = merge_aggregates(msgs, edges)
    ref_idx, ref_val = aggregate_reference.merge_parts(parts, edges)
    assert same_bits(merged.indices, ref_idx) and same_bits(merged.values, ref_val)
    dense = list(parts)
    dense[1] = (None, rng.standard_normal(1500).astype(np.float32))
    msgs[1] = protocol.Message("aggregate", {"workers": 2, "dense": True}, None, dense[1][1])
    assert same_bits(merge_aggregates(msgs, edges).values, aggregate_reference.merge_parts(dense, edges)[1])
    assert global_indices([], edges).size == 0


# ------------------------------------------------------------------------- index coding
def index_sets():
    rng = np.random.default_rng(11)
    yield np.empty(0, np.int64)
    yield np.array([0])
    yield np.array([2**62])
    yield np.cumsum([5, 127, 128, 16383, 16384, 2**21, 2**28 - 1, 2**28, 2**35, 2**49])
    yield np.sort(rng.choice(12_500_000, 125_000, replace=False))
    yield np.arange(10_000)
    yield np.sort(rng.choice(2**31 - 1, 5000, replace=False))
    # every varint length at once, in a set long enough for the kernels (not jit.SMALL's
    # numpy path): gaps of 2**b - 1 and 2**b for every bit length b, in turn, then repeated
    gaps = [g for b in range(1, 55) for g in (2**b - 1, 2**b)]
    yield np.cumsum(np.array(gaps * 80, dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_delta_and_bitmap_coding_equal_the_reference(dtype):
    for idx in index_sets():
        if idx.size and idx[-1] > np.iinfo(dtype).max:
            continue
        idx = idx.astype(dtype)
        frame = codec.encode_delta(idx)
        assert same_bits(frame, codec_reference.encode_delta(idx))
        assert codec.delta_size(idx) == codec_reference.delta_size(idx) == frame.size
        read_only = np.frombuffer(frame.tobytes(), np.uint8)
        assert same_bits(codec.decode_delta(read_only, idx.size),
                         codec_reference.decode_delta(read_only, idx.size))
        numel = int(idx[-1]) + 1 if idx.size else 1
        if numel <= 20_000_000:
            bitmap = codec.encode_bitmap(idx, numel)
            assert same_bits(bitmap, codec_reference.encode_bitmap(idx, numel))
            assert same_bits(codec.decode_bitmap(bitmap, idx.size, numel),
                             codec_reference.decode_bitmap(bitmap, idx.size, numel))
        for model in (numel, 10 * numel + 8):
            fmt, size = codec.choose(idx, model, idx.itemsize)
            got_fmt, got_frame = codec.encode_smallest(idx, model, idx.itemsize)
            assert got_fmt == fmt and np.asarray(got_frame).nbytes == size


def decoded(fn, *args):
    """fn's result or its error text, to compare a kernel's refusal with the reference's."""
    try:
        return fn(*args).tolist()
    except CodecError as exc:
        return str(exc)


def gap_sum_near_2_63(frame: bytes) -> bool:
    """The one intentional difference: the reference bounds the indices by a float64 sum of
    the gaps, which rounds sums just below 2**63 up to it; the kernel sums exactly."""
    value, shift, total = 0, 0, 0
    for b in frame:
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            total, value, shift = total + value, 0, 0
    return 2**63 - 2**11 <= total < 2**63


@HYPOTHESIS
@given(st.binary(max_size=40), st.integers(0, 45), st.sampled_from([np.int32, np.int64]))
def test_hostile_delta_frames_are_refused_as_the_reference_refuses_them(frame, count, dtype):
    data = np.frombuffer(frame, np.uint8)
    got = decoded(codec.decode_delta, data, count, dtype)
    want = decoded(codec_reference.decode_delta, data, count)
    assert got == want or (gap_sum_near_2_63(frame) and want == "delta-encoded indices overflow")


def test_long_hostile_delta_frames_are_refused_as_the_reference_refuses_them():
    """Frames of thousands of varints: bytes changed anywhere, cut short, or given the wrong
    count."""
    rng = np.random.default_rng(17)
    base = codec.encode_delta(np.sort(rng.choice(2**20, 3000, replace=False))).tobytes()
    for trial in range(300):
        frame = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(frame)))
            frame[at] = int(rng.choice([0x00, 0x80, 0xFF, 0x01, rng.integers(0, 256)]))
        if trial % 7 == 0:
            frame = frame[:int(rng.integers(1, len(frame)))]
        count = 3000 + int(rng.choice([0, 0, 0, -1, 1]))
        data = np.frombuffer(bytes(frame), np.uint8)
        for dtype in (np.int32, np.int64):
            assert decoded(codec.decode_delta, data, count, dtype) == \
                decoded(codec_reference.decode_delta, data, count)


def test_int32_delta_decoding_falls_back_to_int64_beyond_int32():
    for idx in ([5, 2**31 - 1], [5, 2**31], [2**33], [1, 2**35 + 2], [0, 2**32 + 3]):
        frame = codec.encode_delta(np.array(idx, np.int64))
        got = codec.decode_delta(frame, len(idx), np.int32)
        assert got.tolist() == idx
        assert got.dtype == (np.int32 if idx[-1] < 2**31 else np.int64)


@HYPOTHESIS
@given(st.binary(min_size=1, max_size=12), st.integers(1, 96), st.integers(0, 100))
def test_hostile_bitmap_frames_are_refused_as_the_reference_refuses_them(frame, numel, count):
    data = np.frombuffer(frame, np.uint8)
    assert decoded(codec.decode_bitmap, data, count, numel) == \
        decoded(codec_reference.decode_bitmap, data, count, numel)


def test_delta_frames_at_the_2_63_bound():
    below = bytes([0xFF] * 8 + [0x7F])  # 2^63 - 1 in 9 bytes: the largest index there is
    assert codec.decode_delta(np.frombuffer(below, np.uint8), 1).tolist() == [2**63 - 1]
    with pytest.raises(CodecError, match="overflow"):
        codec.decode_delta(np.frombuffer(bytes([1]) + below, np.uint8), 2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_frame_checks_equal_the_reference(dtype):
    rng = np.random.default_rng(13)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        idx = np.sort(rng.integers(-3, 60, n)).astype(dtype)
        if rng.random() < 0.5:
            idx = np.unique(idx)
        if n and rng.random() < 0.2:
            idx = rng.permutation(idx)
        values = rng.standard_normal(idx.size).astype(np.float32)
        if idx.size and rng.random() < 0.3:
            values[rng.integers(0, idx.size)] = rng.choice([np.nan, np.inf, -np.inf])
        frame_idx = np.frombuffer(idx.tobytes(), dtype)  # as received: read-only views
        frame_val = np.frombuffer(values.tobytes(), np.float32)
        for numel in (None, 50, 60):
            for order in (True, False):
                for vals in (frame_val, None):
                    assert protocol.sparse_frame_problem(frame_idx, vals, numel, order) == \
                        codec_reference.sparse_frame_problem(frame_idx, vals, numel, order)


def test_all_finite_on_edge_values():
    for values in ([], [1.0], [3e38, 3e38], [1e-45], [np.nan], [np.inf], [-np.inf],
                   [0.0] * 17 + [np.nan]):
        v = np.array(values, np.float32)
        assert protocol.all_finite(v) == codec_reference.all_finite(v) == bool(np.isfinite(v).all())


# ------------------------------------------------------------------------- the cache
def test_a_fresh_process_loads_every_kernel_from_the_cache():
    jit.warm_up()  # compiled and cached here if no earlier process did
    probe = ("import json, numba; from psparse.ops import jit; from psparse.ops.aggregate import agg_kernels; from psparse.ops.codec import codec_kernels; "
             "jit.warm_up(); kernels = [f for m in (agg_kernels, codec_kernels) "
             "for f in vars(m).values() if isinstance(f, numba.core.dispatcher.Dispatcher)]; "
             "print(json.dumps([sum(f.stats.cache_misses.values()) for f in kernels]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    misses = json.loads(out.stdout.strip().splitlines()[-1])
    assert misses and sum(misses) == 0, f"compiled instead of loaded: {misses}"


def test_a_module_another_process_is_warming_up_is_taken_last_and_loaded_after_it():
    """Processes warming up together share the compile: with select_kernels' lock held here
    (as a process compiling it holds it), a warm-up does the other two modules, then waits
    for the lock and loads select_kernels from the cache once it is free."""
    import fcntl

    from psparse.ops.select import select_kernels

    jit.warm_up()  # a complete cache: what the probe does while it waits is loading only
    with open(jit._lock_path(select_kernels), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        probe = subprocess.Popen([sys.executable, "-m", "psparse.ops.jit"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        done = [probe.stdout.readline() for _ in range(3)]  # the cache line, then two modules
        # (in either order: another test's warm-up may hold one of them for a moment)
        assert sorted(line.split(":")[0].strip() for line in done[1:]) == \
            ["agg_kernels", "codec_kernels"], done
        time.sleep(0.5)
        assert probe.poll() is None  # waiting for select_kernels' lock
    rest, _ = probe.communicate(timeout=120)  # the lock is free: it loads and ends
    assert probe.returncode == 0 and "select_kernels:" in rest and "all kernels:" in rest, rest


def test_strided_arrays_are_checked_as_their_values():
    """The kernels read whole cache lines from an array's start: the protocol's and the codec's
    entry points hand them contiguous arrays, so a strided view answers as its values do."""
    values = np.ones(40_000, np.float32)
    values[1::2] = np.nan  # every other value: a strided view of the rest is all finite
    assert protocol.all_finite(values[::2]) and not protocol.all_finite(values)
    idx = np.arange(80_000, dtype=np.int32)
    assert protocol.sparse_frame_problem(idx[::2], values[::2], 10**6, True) is None
    assert protocol.sparse_frame_problem(idx[::-2], values[::2], 10**6, True) is not None
    want = np.arange(0, 90_000, 3)
    frame = codec.encode_delta(want)
    spread = np.zeros(2 * frame.size, np.uint8)
    spread[::2] = frame
    assert np.array_equal(codec.decode_delta(spread[::2], want.size), want)
