"""Compiled CPU kernels of the index coding and the protocol's frame checks (numba; see
psparse/jit.py). One pass each over the indices or the frame; each equals its numpy reference
in psparse/reference.py (tests/test_cpu_kernels.py). They import nothing above psparse.jit.

Their loops avoid data-dependent branches where the data decide them (a varint's length, the
end of a varint, a word's set bits): on the development machine a mispredicted branch costs
~10 ns, several times the work of an entry. Problems are returned as counts and flags; the
callers (psparse/codec.py, psparse/protocol.py) turn them into the protocol's error texts.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit import kernel, trailing_zeros

MAX_VARINT_BYTES = 10  # a 64-bit gap needs at most 10 groups of 7 bits
ENCODE_SLACK = 4  # bytes past a delta frame's end that the encoder may write (then cut off)
INT64_MAX = np.uint64(2**63 - 1)

# check_sparse's flags
BAD_ORDER, NEGATIVE, OUT_OF_RANGE, NOT_FINITE = 1, 2, 4, 8
# decode_delta's flags (the count of varints comes back separately)
TOO_LONG, GROUP_OVERFLOW, ZERO_GAP, SUM_OVERFLOW = 1, 2, 4, 8


@intrinsic
def _leading_zeros(typingctx, word):
    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))
    return types.uint64(types.uint64), codegen


@kernel
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
    form is smaller: the caller stops paying for this one)."""
    size = np.int64(0)
    previous = np.int64(0)
    for i in range(indices.size):
        current = np.int64(indices[i])
        gap = np.uint64(current - previous)
        previous = current
        length = _varint_length(gap)
        if size + length > capacity:
            return -1
        # the first four groups are written whether they exist or not (no branch on the
        # length): the next varint, or the slack, overwrites what is past this one
        for g in range(4):
            more = np.uint8(0x80) if g + 1 < length else np.uint8(0)
            out[size + g] = np.uint8((gap >> np.uint64(7 * g)) & np.uint64(0x7F)) | more
        for g in range(4, length):  # gaps of 2**28 and more
            more = np.uint8(0x80) if g + 1 < length else np.uint8(0)
            out[size + g] = np.uint8((gap >> np.uint64(7 * g)) & np.uint64(0x7F)) | more
        size += length
    return size


@kernel
def decode_delta(data, count, out):
    """Parse a delta frame into ``out`` (count + 1 int64 slots; the indices are out[:count]).

    Returns (varints in the frame, flags): TOO_LONG a varint of more than 10 bytes,
    GROUP_OVERFLOW a 10th group above 1 (a gap of 2**64 or more), ZERO_GAP a repeated index,
    SUM_OVERFLOW an index of 2**63 or more. Every byte takes the same path: the varint's
    end, the running index and the checks are selects, not branches.
    """
    flags = 0
    varints = np.int64(0)
    gap = np.uint64(0)
    shift = np.uint64(0)
    index = np.uint64(0)
    for p in range(data.size):
        byte = np.uint64(data[p])
        group = byte & np.uint64(0x7F)
        flags |= TOO_LONG if shift >= np.uint64(7 * MAX_VARINT_BYTES) else 0
        flags |= GROUP_OVERFLOW if (shift == np.uint64(63) and group > np.uint64(1)) else 0
        gap |= group << min(shift, np.uint64(63))
        end = byte < np.uint64(0x80)
        following = index + gap
        wrapped = following < index or following > INT64_MAX
        flags |= SUM_OVERFLOW if (end and wrapped) else 0
        flags |= ZERO_GAP if (end and varints > 0 and gap == np.uint64(0)) else 0
        out[min(varints, count)] = np.int64(following)  # count + 1 slots: always in bounds
        index = following if end else index
        varints += end
        gap = np.uint64(0) if end else gap
        shift = np.uint64(0) if end else shift + np.uint64(7)
    return varints, flags


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
        disorder = False
        for i in range(1, n):
            disorder |= indices[i] <= indices[i - 1]
        flags |= BAD_ORDER if disorder else 0
        flags |= NEGATIVE if indices[0] < 0 else 0
    flags |= OUT_OF_RANGE if (numel >= 0 and indices[n - 1] >= numel) else 0
    flags |= 0 if all_finite(values) else NOT_FINITE
    return flags


@kernel
def all_finite(values):
    """No NaN or inf among float32 ``values`` (an exponent of all ones is either)."""
    bits = values.view(np.uint32)
    bad = np.uint32(0)
    for i in range(bits.size):
        bad |= np.uint32(1) if (bits[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000) \
            else np.uint32(0)
    return bad == 0


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
    decode_delta(frame, 2, np.empty(3, np.int64))
    decode_bitmap(frame, 2, np.empty(2, np.int64))
    all_finite(np.frombuffer(values.tobytes(), np.float32))
    all_finite(values)
