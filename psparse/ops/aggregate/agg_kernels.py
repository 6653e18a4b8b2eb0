"""The server's round arithmetic compiled for the CPU: sums, size-limit merge, vote, shard split.

Compiled CPU kernels of the server's round arithmetic (numba; see psparse/ops/jit.py and
psparse/ops/numba_jit.py).

Each kernel equals its numpy reference (``reference.py`` beside this file) bit for bit;
tests/test_cpu_kernels.py holds them to it. They import nothing above psparse.ops.jit.

* ``sparse_sum``: N sorted pushes (index, value), given as tables of addresses (the received
  frames are read where they lie), summed in rank order at the sorted union of their indices. The
  index space is walked in blocks small enough for the caches (``block_bits``); in each block every
  push's run of entries is marked in a bitmap, a prefix sum of the words' bit counts gives each
  entry its position in the block's union, and the entries are added straight into the output there,
  push after push. So every entry is summed as ``((0 + v_0) + v_1) + ...`` over the ranks that hold
  it, as numpy's ``add.at`` into a zeroed accumulator does, and nothing model-sized is touched.
  Measured against it (benchmarks/bench_aggregation.py, docs/notes/bench-cpu-kernels.md): a k-way
  merge of the N lists (a branch per list per output), and a dense scratch per block read out
  through the bitmap in index order (the read-out took half the time: a branch per word and per set
  bit).
* ``divide``: the sums divided by N, in place (a separate loop: it vectorises).
* ``dense_sum``: the same when a push is dense (every index): a rank-order sum into the
  model-sized accumulator, read out and zeroed.
* ``merge_residual``: ``--server-limit``'s candidates, the round's union merged with the
  residual's support, with the residual added.
* ``top_k``: the sorted positions of the k largest |x| (ties: the lower position), as
  ``sparsify.topk_exact``; ``partition_kept``: the kept and held entries split in one pass.
* ``shifted_copy`` / ``shifted_scatter``: the key-range shards' split (global -> shard-relative
  indices, narrowed to the wire's dtype) and merge (shard-relative -> global).
"""

from __future__ import annotations

import numba
import numpy as np

from ..numba_jit import as_pointer, kernel, population_count

MIN_BLOCK_BITS, BLOCK_BITS, MAX_BLOCK_BITS = 13, 16, 20  # 128 .. 16k bitmap words a block


def block_bits_for(numel: int) -> int:
    """Block size (log2): 2**16 entries (an 8 KiB bitmap and its 4 KiB of word offsets, in L1
    with the block's share of the output), or the whole model when it is smaller.
    benchmarks/bench_aggregation.py --variants times the others."""
    return int(min(BLOCK_BITS, max(MIN_BLOCK_BITS, int(np.ceil(np.log2(max(2, numel)))))))


@kernel
def _run_end(index, start, stop, bound):
    """First position in [start, stop] of sorted ``index`` whose value is >= bound (stop if
    none): a binary search whose steps are selects, not branches."""
    n = stop - start
    if n <= 0:
        return start
    lo = start
    while n > 1:
        half = n >> 1
        lo = lo + half if np.int64(index[lo + half]) < bound else lo
        n -= half
    return lo + (np.int64(index[lo]) < bound)


@kernel
def sparse_sum(index_addresses, value_addresses, lengths, index_proto, absolute, out_index,
               out_value, block_bits, bits, offsets):
    """Sum N sorted, duplicate-free pushes in rank order at their sorted union.

    Push r's indices (``index_proto``'s dtype) and float32 values are ``lengths[r]`` entries at
    ``index_addresses[r]`` / ``value_addresses[r]``. ``absolute``: sum |value| (the vote's
    score). Writes the union to ``out_index`` and the sums to ``out_value`` (room for
    sum(lengths) entries) and returns its size. ``bits`` (2**block_bits / 64 zeros, uint64) is
    left zeroed; ``offsets`` (as many uint32) is scratch. Block by block: every push's run of
    entries is marked in the bitmap, each word's first union position is the count of bits
    before it (a prefix sum), and then each entry is added straight into its output slot (its
    word's offset plus the bits below it in the word), the pushes in rank order, so every sum
    is ``((0 + v_0) + v_1) + ...`` with nothing read out afterwards. Input that breaks the
    contract (unsorted, duplicates) gives a wrong answer but never writes out of bounds.
    """
    pushes = lengths.size
    block = np.int64(1) << block_bits
    position = np.zeros(pushes, np.int64)
    stops = np.zeros(pushes, np.int64)
    none_left = np.iinfo(np.int64).max
    count = np.int64(0)
    while True:
        first = none_left  # the smallest index not yet summed: its block is next
        for r in range(pushes):
            if position[r] < lengths[r]:
                index = numba.carray(as_pointer(index_addresses[r]), (lengths[r],),
                                     index_proto.dtype)
                first = min(first, np.int64(index[position[r]]))
        if first == none_left:
            break
        lo = (first >> block_bits) << block_bits
        last = _mark_block(index_addresses, lengths, index_proto, position, stops, lo, block,
                           bits)
        w0, w1 = np.uint64((first - lo) >> 6), np.uint64((last >> 6) + 1)
        union = _word_offsets(bits, w0, w1, offsets)
        out_value[count:count + union] = 0.0
        for r in range(pushes):  # rank order: each entry's sum is formed in it
            if stops[r] > position[r]:
                n = lengths[r]
                index = numba.carray(as_pointer(index_addresses[r]), (n,), index_proto.dtype)
                value = numba.carray(as_pointer(value_addresses[r]), (n,), np.float32)
                _add_run(index, value, np.uint64(position[r]), np.uint64(stops[r]), lo,
                         np.uint64(block), bits, offsets, np.uint64(count),
                         np.uint64(count + max(union, 1) - 1), out_index, out_value, absolute)
            position[r] = stops[r]
        bits[w0:w1] = 0
        count += union
    return count


# The loops below index with unsigned integers: numba then emits no wraparound code for
# negative indices, and the few live values fit in registers.
@kernel
def _mark_block(index_addresses, lengths, index_proto, position, stops, lo, block, bits):
    """Mark every push's run in the block at ``lo`` (from position[r] to stops[r], set here);
    returns the largest offset marked."""
    last = np.int64(0)
    for r in range(lengths.size):
        n = lengths[r]
        start = position[r]
        stops[r] = start
        if start >= n:
            continue
        index = numba.carray(as_pointer(index_addresses[r]), (n,), index_proto.dtype)
        stop = _run_end(index, start, n, lo + block)
        _mark_run(index, np.uint64(start), np.uint64(stop), lo, np.uint64(block), bits)
        if stop > start:
            last = max(last, np.int64(index[stop - 1]) - lo)
        stops[r] = stop
    return last


@kernel
def _mark_run(index, start, stop, lo, block, bits):
    """Set bit index - lo in ``bits`` for every entry of [start, stop)."""
    for t in range(start, stop):
        j = np.uint64(np.int64(index[t]) - lo)
        if j < block:  # always, for sorted input: unsorted input may not corrupt memory
            bits[j >> np.uint64(6)] |= np.uint64(1) << (j & np.uint64(63))


@kernel
def _word_offsets(bits, w0, w1, offsets):
    """offsets[w] = set bits in words [w0, w); returns the set bits in [w0, w1)."""
    total = np.int64(0)
    for w in range(w0, w1):
        offsets[w] = total
        total += np.int64(population_count(bits[w]))
    return total


@numba.njit(inline="always", nogil=True, cache=True)
def _slot(entry, lo, block, bits, offsets, base, limit):
    """(output slot, index) of a pushed index: base + its rank in the block's union (its
    word's offset and the bits below it), clamped to ``limit`` (reached by unsorted input
    only: a wrong answer, never a stray write)."""
    j = np.uint64(np.int64(entry) - lo) & (block - np.uint64(1))
    w = j >> np.uint64(6)
    below = bits[w] & ((np.uint64(1) << (j & np.uint64(63))) - np.uint64(1))
    return min(base + np.uint64(offsets[w]) + population_count(below), limit), lo + np.int64(j)


@kernel
def _add_run(index, value, start, stop, lo, block, bits, offsets, base, limit, out_index,
             out_value, absolute):
    """out_value[slot] += value (|value| with ``absolute``: the vote's score) and
    out_index[slot] = index over [start, stop); one loop per case, so neither tests it."""
    if absolute:
        for t in range(start, stop):
            slot, at = _slot(index[t], lo, block, bits, offsets, base, limit)
            out_index[slot] = at
            out_value[slot] += abs(value[t])
    else:
        for t in range(start, stop):
            slot, at = _slot(index[t], lo, block, bits, offsets, base, limit)
            out_index[slot] = at
            out_value[slot] += value[t]


@kernel
def divide(values, count, divisor):
    """values[:count] /= divisor (float32, rounded once each, as numpy divides)."""
    for t in range(count):
        values[t] = values[t] / divisor


@kernel
def dense_sum(accumulator, index_addresses, value_addresses, lengths, dense, index_proto,
              absolute, out_value, divisor):
    """Rank-order sum of N pushes into the model-sized zeroed ``accumulator`` (push r dense
    where ``dense[r]``: its values are the whole vector), then out_value = sums / divisor over
    every index; the accumulator is left zeroed."""
    numel = accumulator.size
    for r in range(lengths.size):
        n = lengths[r]
        value = numba.carray(as_pointer(value_addresses[r]), (n,), np.float32)
        if dense[r]:
            for j in range(numel):
                accumulator[j] += abs(value[j]) if absolute else value[j]
        else:
            index = numba.carray(as_pointer(index_addresses[r]), (n,), index_proto.dtype)
            for t in range(n):
                j = np.int64(index[t])
                if 0 <= j < numel:  # always, for valid input: bad input may not corrupt memory
                    accumulator[j] += abs(value[t]) if absolute else value[t]
    for j in range(numel):
        out_value[j] = accumulator[j] / divisor
        accumulator[j] = 0.0


@kernel
def merge_residual(union, mean, support, residual, out_index, out_value):
    """The size limit's candidates: the sorted union of ``union`` (this round's aggregate) and
    ``support`` (where ``residual`` is nonzero), valued residual + mean (residual alone off the
    union; 0 + mean off the support, as a gather of the zero residual there gives). The
    residual is zeroed at its support. Returns the count."""
    a, b, count = 0, 0, 0
    na, nb = union.size, support.size
    while a < na or b < nb:
        i = np.int64(union[a]) if a < na else np.iinfo(np.int64).max
        s = support[b] if b < nb else np.iinfo(np.int64).max
        j = min(i, s)
        v = residual[j]
        if i == j:
            v += mean[a]
            a += 1
        if s == j:
            residual[j] = 0.0
            b += 1
        out_index[count] = j
        out_value[count] = v
        count += 1
    return count


@kernel
def top_k(x, k, nonnegative, out):
    """The sorted positions of the k largest |x| (``nonnegative``: x >= 0, so |x| is x), ties
    to the lower position, written to ``out`` (k entries); 0 < k < x.size. Returns -1 if x
    holds NaN or inf (nothing written), else k."""
    n = x.size
    magnitude = np.empty(n, np.float32)
    finite = True
    for j in range(n):
        m = x[j] if nonnegative else abs(x[j])
        finite &= np.isfinite(m)
        magnitude[j] = m
    if not finite:
        return -1
    kth = np.partition(magnitude.copy(), n - k)[n - k]
    above = 0
    for j in range(n):
        above += magnitude[j] > kth
    ties = k - above  # how many entries equal to the k-th magnitude are kept: the lowest
    count = 0
    for j in range(n):
        m = magnitude[j]
        if m > kth or (m == kth and ties > 0):
            if m == kth:
                ties -= 1
            out[count] = j
            count += 1
    return count


@kernel
def partition_kept(indices, values, kept, kept_index, kept_value, held_index, residual):
    """Split sorted candidates by the sorted positions ``kept``: those go to kept_index /
    kept_value, the rest to held_index with their values written to ``residual``."""
    a, h = 0, 0
    nk = kept.size
    for j in range(indices.size):
        if a < nk and kept[a] == j:
            kept_index[a] = indices[j]
            kept_value[a] = values[j]
            a += 1
        else:
            held_index[h] = indices[j]
            residual[indices[j]] = values[j]
            h += 1


@kernel
def shifted_copy(source, start, stop, shift, out, at):
    """out[at + i] = source[start + i] + shift for i < stop - start, cast to out's dtype
    (one pass: a key-range shard's slice of a push, or a shard's aggregate made global)."""
    for i in range(stop - start):
        out[at + i] = source[start + i] + shift


@kernel
def shifted_scatter(out, index, value, shift):
    """out[index + shift] = value: a shard's sparse aggregate into the merged dense vector."""
    for t in range(index.size):
        out[np.int64(index[t]) + shift] = value[t]


def warm_up() -> None:
    """Compile or load every kernel for the argument types the package passes."""
    for dtype in (np.int32, np.int64):
        idx = np.array([1, 3], dtype)
        val = np.array([0.5, -1.0], np.float32)
        addresses = np.array([idx.ctypes.data], np.int64)
        values = np.array([val.ctypes.data], np.int64)
        lengths = np.array([2], np.int64)
        out_val = np.empty(2, np.float32)
        bits = np.zeros((1 << MIN_BLOCK_BITS) // 64, np.uint64)
        offsets = np.empty(bits.size, np.uint32)
        for out_dtype in {np.int32, dtype}:  # the union in the model's natural dtype
            out_idx = np.empty(2, out_dtype)
            absolute = False  # a bool argument: one signature for both values
            sparse_sum(addresses, values, lengths, idx, absolute, out_idx, out_val,
                       MIN_BLOCK_BITS, bits, offsets)
            dense_sum(np.zeros(4, np.float32), addresses, values, lengths,
                      np.zeros(1, np.bool_), idx, absolute, np.empty(4, np.float32),
                      np.float32(1))
        residual = np.zeros(4, np.float32)
        merge_residual(idx, val, np.array([2], np.int64), residual, np.empty(3, np.int64),
                       np.empty(3, np.float32))
        for shift_out in (np.empty(2, np.int32), np.empty(2, np.int64)):
            shifted_copy(idx, 0, 2, np.int64(-1), shift_out, 0)
        shifted_scatter(np.zeros(8, np.float32), idx, val, np.int64(2))
    divide(np.ones(2, np.float32), 2, np.float32(2))
    for nonnegative in (False, True):
        top_k(np.array([1.0, -2.0], np.float32), 1, nonnegative, np.empty(1, np.int64))
    partition_kept(np.array([1, 3], np.int64), np.ones(2, np.float32), np.array([0], np.int64),
                   np.empty(1, np.int64), np.empty(1, np.float32), np.empty(1, np.int64),
                   np.zeros(4, np.float32))
