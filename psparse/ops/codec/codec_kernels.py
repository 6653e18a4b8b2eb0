"""Index coding and the protocol's frame checks, compiled for the CPU.

Compiled CPU kernels of the index coding and the protocol's frame checks (numba; see
psparse/ops/jit.py, psparse/ops/numba_jit.py). One pass each over the indices or the frame; each
equals its numpy reference in ``reference.py`` beside this file (tests/test_cpu_kernels.py). They
import nothing above psparse.ops.jit.

The arrays they take are C-contiguous (several read whole cache lines from an array's start: the
callers in psparse/ops/codec/codec.py and psparse/wire/protocol.py make them so). Their loops avoid
data-dependent branches where the data decide them (a varint's length, the end of a varint, a word's
set bits): on the development machine a mispredicted branch costs ~10 ns, several times the work of
an entry. Problems are returned as counts and flags; the callers (psparse/ops/codec/codec.py,
psparse/wire/protocol.py) turn them into the protocol's error texts.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..numba_jit import (
    continued_5,
    continued_9,
    kernel,
    magnitude_mask,
    not_increasing_32,
    not_increasing_64,
    trailing_zeros,
)

MAX_VARINT_BYTES = 10  # a 64-bit gap needs at most 10 groups of 7 bits
ENCODE_SLACK = 4  # bytes past a delta frame's end that the encoder may write (then cut off)
INT64_MAX = np.uint64(2**63 - 1)
INF_BITS32, SIGN_OFF32 = np.uint32(0x7F800000), np.uint32(0x7FFFFFFF)

# check_sparse's flags
BAD_ORDER, NEGATIVE, OUT_OF_RANGE, NOT_FINITE = 1, 2, 4, 8
# decode_delta's flags (the count of varints comes back separately)
TOO_LONG, GROUP_OVERFLOW, ZERO_GAP, SUM_OVERFLOW, WIDE = 1, 2, 4, 8, 16


@intrinsic
def _leading_zeros(typingctx, word):
    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))
    return types.uint64(types.uint64), codegen


@intrinsic
def _store_u32(typingctx, address, value):
    """Store the low 32 bits of ``value`` at byte address ``address`` (any alignment, the
    machine's byte order: little-endian, as codec.py asserts)."""
    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.store(builder.trunc(args[1], ir.IntType(32)), pointer, align=1)
        return context.get_dummy_value()
    return types.void(types.int64, types.uint64), codegen


# by bit length (64 - leading zeros): bytes of the varint; by bytes: the continuation bits of
# its first four. Looked up: the encoder's loop is bound by its instructions, and the tables
# took ~20% off it (a division by 7 and a variable shift per index before)
_LENGTH_BY_BITS = np.array([max(1, (bits + 6) // 7) for bits in range(65)], np.int64)
_MORE_BY_LENGTH = np.array([0x80808080 & ((1 << (8 * min(max(n - 1, 0), 4))) - 1)
                            for n in range(MAX_VARINT_BYTES + 1)], np.uint64)


@numba.njit(inline="always", nogil=True, cache=True)
def _varint_length(gap):
    """Bytes of ``gap`` as an LEB128 varint: ceil(bit length / 7), at least 1."""
    bits = np.uint64(64) - _leading_zeros(gap | np.uint64(1))
    return np.int64((bits + np.uint64(6)) // np.uint64(7))


@kernel
def delta_size(indices):
    """Bytes of the delta form of sorted ``indices`` (the first index, then the gaps)."""
    total = np.int64(0)
    previous = np.int64(0)
    for i in range(indices.size):
        current = np.int64(indices[i])
        total += _varint_length(np.uint64(current - previous))  # a negative gap: 10 bytes
        previous = current
    return total


@kernel
def encode_delta(indices, out, capacity):
    """Write the delta form of sorted ``indices`` to ``out`` (capacity + ENCODE_SLACK bytes)
    and return its size, or -1 as soon as it would exceed ``capacity`` bytes (then another
    form is smaller: the caller stops paying for this one).

    A varint's first four bytes go out as one 32-bit store whatever its length (the next
    varint, or the slack, overwrites what lies past it): its four 7-bit groups spread to byte
    boundaries, with the continuation bits of the bytes that exist but the last.
    """
    n = indices.size
    base = out.ctypes.data
    # runs unchecked as long as even 10 bytes per index stay within the capacity (each run
    # as long as what is left allows), then the last few indices checked one by one
    size, done = np.int64(0), np.int64(0)
    while done < n:
        run = min(n - done, (capacity - size) // MAX_VARINT_BYTES)
        if run < 64:
            break
        size = _encode_run(indices, done, done + run, size, base, out)
        done += run
    previous = np.int64(indices[done - 1]) if done > 0 else np.int64(0)
    for i in range(done, n):
        current = np.int64(indices[i])
        gap = np.uint64(current - previous)
        previous = current
        length = _LENGTH_BY_BITS[np.uint64(64) - _leading_zeros(gap)]
        if size + length > capacity:
            return -1
        _store_u32(base + size, _first_four(gap, length))
        if length > 4:  # gaps of 2**28 and more
            _write_tail(out, size, gap, length)
        size += length
    return size


ENCODE_CHUNK = 1024  # indices whose varints one pass forms before another stores them


@kernel
def _encode_run(indices, start, stop, size, base, out):
    """encode_delta's loop over indices[start:stop] without the capacity check, a chunk at a
    time in two passes: ``_form_varints`` (each gap's first four bytes and its length, no
    dependence between indices: it vectorises) and ``_store_varints`` (the 32-bit stores at
    the running size: a store and an add an index). One pass doing both was bound by its
    instructions, ~2.3x the time (its stores wait on the sizes, the sizes on the gaps)."""
    words = np.empty(ENCODE_CHUNK, np.uint32)
    lengths = np.empty(ENCODE_CHUNK, np.uint8)
    for chunk in range(start, stop, ENCODE_CHUNK):
        end = min(stop, chunk + ENCODE_CHUNK)
        _form_varints(indices, chunk, end, words, lengths)
        size = _store_varints(indices, chunk, end, words, lengths, size, base, out)
    return size


@kernel
def _form_varints(indices, start, stop, words, lengths):
    """words[i - start]: the first four bytes of gap i's varint (``_first_four``), and
    lengths[i - start] its length in bytes, for i in [start, stop)."""
    previous = np.int64(indices[start - 1]) if start > 0 else np.int64(0)
    for i in range(start, stop):
        current = np.int64(indices[i])
        gap = np.uint64(current - previous)
        previous = current
        bits = np.uint64(64) - _leading_zeros(gap | np.uint64(1))
        # ceil(bits / 7) for 1 <= bits <= 64, without a division or a table (both kept it
        # from vectorising); tests/test_cpu_kernels.py checks every bit length
        length = (bits * np.uint64(37) + np.uint64(222)) >> np.uint64(8)
        more = np.uint64(0x80808080) \
            & ((np.uint64(1) << (np.uint64(8) * min(length - np.uint64(1), np.uint64(4))))
               - np.uint64(1))
        words[i - start] = np.uint32(_spread(gap) | more)
        lengths[i - start] = np.uint8(length)


@kernel
def _store_varints(indices, start, stop, words, lengths, size, base, out):
    """Store the formed varints from byte ``size`` on; returns the size after them."""
    for i in range(start, stop):
        length = np.int64(lengths[i - start])
        _store_u32(base + size, np.uint64(words[i - start]))
        if length > 4:  # gaps of 2**28 and more: their bytes past the fourth
            previous = np.int64(indices[i - 1]) if i > 0 else np.int64(0)
            _write_tail(out, size, np.uint64(np.int64(indices[i]) - previous), length)
        size += length
    return size


@numba.njit(inline="always", nogil=True, cache=True)
def _spread(gap):
    """The low 28 bits of ``gap`` as four 7-bit groups, one a byte (continuation bits clear)."""
    seven = np.uint64(0x7F)
    return (gap & seven) | ((gap << np.uint64(1)) & (seven << np.uint64(8))) \
        | ((gap << np.uint64(2)) & (seven << np.uint64(16))) \
        | ((gap << np.uint64(3)) & (seven << np.uint64(24)))


@numba.njit(inline="always", nogil=True, cache=True)
def _first_four(gap, length):
    """A varint's first four bytes as a little-endian 32-bit word."""
    return _spread(gap) | _MORE_BY_LENGTH[length]


@kernel
def _write_tail(out, at, gap, length):
    """Bytes 4.. of a varint longer than four."""
    for g in range(4, length):
        follow = np.uint8(g + 1 < length) << np.uint8(7)  # the continuation bit
        out[at + g] = np.uint8((gap >> np.uint64(7 * g)) & np.uint64(0x7F)) | follow


@kernel
def decode_delta(data, count, out, wide_shift):
    """Parse a delta frame into ``out`` (data.size + 1 slots of the indices' dtype, int32 or
    int64; the indices are out[:count]).

    Returns (varints in the frame, flags, the last index as int64 bits): TOO_LONG a varint of
    more than 10 bytes, GROUP_OVERFLOW a 10th group above 1 (a gap of 2**64 or more), ZERO_GAP
    a repeated index, SUM_OVERFLOW an index of 2**63 or more, WIDE a varint reaching the group
    at bit ``wide_shift`` (35 for int32 output: its gap may not fit, decode again as int64; 63
    for int64: a 10-byte varint, examined by ``_long_varints``). Every byte takes the same
    path: each 7-bit group is added into the running index at its shift (the groups of a gap
    do not overlap, so adding them one by one is adding the gap), and a varint's end is a mask
    that resets the shift (no select for the compiler to turn into a branch); the checks
    follow in passes of their own: WIDE too (``_continued_run``; tracking the widest shift in
    this loop took 1.7x its time). (Tried: decoding the two halves of a frame as two chains in
    one loop, slower; assembling each gap apart before adding it, ~1.7x the time.)
    """
    shift = np.uint64(0)
    index = np.uint64(0)
    varints = np.uint64(0)
    for p in range(data.size):
        shift, index, varints = _step(data[p], shift, index, varints, out)
    flags = 0
    # a group at bit wide_shift or above: wide_shift / 7 (rounded up) continuation bytes with
    # a byte after them
    if _continued_run(data, (wide_shift + 6) // 7):
        if wide_shift < 63:
            return np.int64(varints), WIDE, np.int64(index)
        flags |= _long_varints(data)
    if varints == np.uint64(count):
        # int32: no gap reached 2**35, and codec.decode_delta decodes again as int64 unless
        # the last index is in [0, 2**31): then nothing wrapped, and a repeat is a zero gap
        if out.itemsize == 4:
            flags |= 0 if _increasing(out[:count]) else ZERO_GAP
        else:
            flags |= _disorder(out, count)
    return np.int64(varints), np.int64(flags), np.int64(index)


@numba.njit(inline="always", nogil=True, cache=True)
def _step(byte, shift, index, varints, out):
    """One byte of a delta frame: (shift, index, varints) after it; the index so far is
    written at out[varints] whether the varint ended or not (varints <= bytes; the frame ends
    on a varint's last byte, so the index returned is whole)."""
    byte = np.uint64(byte)
    last = (byte >> np.uint64(7)) ^ np.uint64(1)  # 1 on a varint's last byte, else 0
    index += (byte & np.uint64(0x7F)) << (shift & np.uint64(63))
    out[varints] = index
    return (shift + np.uint64(7)) & (last - np.uint64(1)), index, varints + last


@kernel
def _continued_run(data, run):
    """Whether ``run`` (5 or 9) consecutive bytes of ``data`` have the continuation bit with
    a byte after them: 64 window starts at a time by one vector AND (``numba_jit.continued_*``;
    numba's own loop of the same ANDs widened them to 64 bits: 0.04 ms for 160 KB), the last
    windows one by one."""
    n = data.size
    start = data.ctypes.data
    windows = max(0, n - run)  # starts s < n - run: a byte follows the run
    full = max(0, windows - run)  # a step from s reads bytes s .. s + 62 + run
    full -= full % 64
    hit = np.uint64(0)
    for s in range(0, full, 64):
        hit |= continued_5(start + s) if run == 5 else continued_9(start + s)
    found = hit != np.uint64(0)
    for s in range(full, windows):
        every = 0xFF
        for q in range(run):
            every &= data[s + q]
        found |= every >= 0x80
    return found


@kernel
def _long_varints(data):
    """TOO_LONG / GROUP_OVERFLOW for a frame holding a varint of 10 or more bytes."""
    flags = 0
    run = 0
    for p in range(data.size):
        byte = data[p]
        if run == 9 and (byte & 0x7F) > 1:
            flags |= GROUP_OVERFLOW
        if run >= MAX_VARINT_BYTES:
            flags |= TOO_LONG
        run = run + 1 if byte & 0x80 else 0
    return flags


@kernel
def _disorder(out, count):
    """ZERO_GAP (an index repeated) and SUM_OVERFLOW (an index past 2**63 - 1, or a sum that
    wrapped) of decoded int64 indices: strictly increasing as unsigned 64-bit values, the last
    one below 2**63. (For int32 output no gap reached 2**35, so nothing wrapped, and the caller
    bounds the last index.)"""
    if count == 0:
        return 0
    repeated, wrapped = False, False
    for i in range(1, count):
        a, b = np.uint64(out[i - 1]), np.uint64(out[i])
        repeated |= b == a
        wrapped |= b < a
    flags = ZERO_GAP if repeated else 0
    if wrapped or np.uint64(out[count - 1]) > INT64_MAX:
        flags |= SUM_OVERFLOW
    return flags


@kernel
def encode_bitmap(indices, words, numel):
    """Set bit i of the little-endian ``words`` (zeros, ceil(numel / 64) uint64) for every
    index i; returns the number of indices outside [0, numel) (none are written)."""
    outside = 0
    current = np.int64(-1)
    bits = np.uint64(0)
    for t in range(indices.size):
        i = np.int64(indices[t])
        if i < 0 or i >= numel:
            outside += 1
            continue
        w = i >> 6
        if w != current:  # sorted input: a word's indices come together
            if current >= 0:
                words[current] |= bits
            current, bits = w, np.uint64(0)
        bits |= np.uint64(1) << np.uint64(i & 63)
    if current >= 0:
        words[current] |= bits
    return outside


@kernel
def decode_bitmap(data, count, out):
    """The set bits of a little-endian bitmap frame, in order, into ``out`` (count slots);
    returns how many bits are set (more than count: the extra are counted, not written)."""
    n = data.size
    found = np.int64(0)
    for start in range(0, n, 8):
        word = np.uint64(0)
        for b in range(min(8, n - start)):
            word |= np.uint64(data[start + b]) << np.uint64(8 * b)
        base = np.int64(start) * 8
        while word:
            if found < count:
                out[found] = base + np.int64(trailing_zeros(word))
            found += 1
            word &= word - np.uint64(1)
    return found


@kernel
def check_sparse(indices, values, numel, check_order):
    """A received sparse frame's checks in one pass: flags BAD_ORDER (not strictly
    increasing), NEGATIVE (first index < 0), OUT_OF_RANGE (last index >= numel, when numel >=
    0), NOT_FINITE (a NaN or inf value; values may be empty: not checked)."""
    n = indices.size
    flags = 0
    if n == 0:
        return flags
    if check_order:
        flags |= 0 if _increasing(indices) else BAD_ORDER
        flags |= NEGATIVE if indices[0] < 0 else 0
    flags |= OUT_OF_RANGE if (numel >= 0 and indices[n - 1] >= numel) else 0
    flags |= 0 if all_finite(values) else NOT_FINITE
    return flags


@kernel
def _increasing(indices):
    """Whether int32 or int64 ``indices`` increase strictly: a vector compare of each value
    with the next, a cache line at a time (``numba_jit.not_increasing_*``), the rest one by
    one."""
    n = indices.size
    start = indices.ctypes.data
    lanes = 16 if indices.itemsize == 4 else 8
    full = (n - 1) - (n - 1) % lanes  # pairs (i, i + 1) with i < full go by lanes
    bad = np.uint64(0)
    for h in range(0, full, lanes):
        at = start + indices.itemsize * h
        bad |= not_increasing_32(at) if indices.itemsize == 4 else not_increasing_64(at)
    disorder = bad != np.uint64(0)
    for i in range(max(full, 1), n):
        disorder |= indices[i] <= indices[i - 1]
    return not disorder


@kernel
def all_finite(values):
    """No NaN or inf among float32 ``values`` (an exponent of all ones is either): 64 at a
    time by ``magnitude_mask`` (|x| from inf's bits up: NaN or inf), at a plain read's speed
    (numba's own loop over the same test ran at a third of it)."""
    n = values.size
    start = values.ctypes.data
    full = n - n % 64
    bad = np.uint64(0)
    for h in range(0, full, 64):
        at = start + 4 * h
        bad |= magnitude_mask(at, INF_BITS32, SIGN_OFF32) \
            | magnitude_mask(at + 64, INF_BITS32, SIGN_OFF32) \
            | magnitude_mask(at + 128, INF_BITS32, SIGN_OFF32) \
            | magnitude_mask(at + 192, INF_BITS32, SIGN_OFF32)
    bits = values.view(np.uint32)
    for i in range(full, n):
        bad |= np.uint64((bits[i] & INF_BITS32) == INF_BITS32)
    return bad == np.uint64(0)


def warm_up() -> None:
    """Compile or load every kernel for the argument types the package passes: indices int32
    and int64, owned or read-only (a received frame)."""
    values = np.ones(2, np.float32)
    for idx in (np.array([1, 5], np.int32), np.array([1, 5], np.int64)):
        for view in (idx, np.frombuffer(idx.tobytes(), idx.dtype)):  # owned, read-only
            delta_size(view)
            encode_delta(view, np.empty(2 + ENCODE_SLACK, np.uint8), 2)
            encode_bitmap(view, np.zeros(1, np.uint64), 8)
            for vals in (values, np.frombuffer(values.tobytes(), np.float32)):
                check_sparse(view, vals, 8, True)
        check_sparse(idx.astype(np.int64), values, -1, False)
    frame = np.frombuffer(bytes([1, 4]), np.uint8)
    for dtype, wide in ((np.int32, 35), (np.int64, 63)):
        decode_delta(frame, 2, np.empty(3, dtype), wide)
    decode_bitmap(frame, 2, np.empty(2, np.int64))
    all_finite(np.frombuffer(values.tobytes(), np.float32))
    all_finite(values)
