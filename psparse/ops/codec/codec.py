"""Compact encodings of a sorted index set, and key caching (part of the protocol layer).

An index frame is sent in whichever of these is smallest for the set at hand:

* ``raw``: int32 (or int64) little-endian, 4 bytes per index;
* ``delta``: the first index, then the gaps between consecutive indices, as LEB128 varints
  (1 byte per gap below 128, 2 below 16,384, ...): clustered sets shrink 2-4x;
* ``bitmap``: one bit per model entry, ceil(numel / 8) bytes: wins for dense-ish sets.

Key caching (ps-lite's key-caching filter): both ends of a connection remember the index sets
they last exchanged; when the next set equals one of them, only an 8-byte key goes on the wire
(``cached``). In two-phase rounds every push repeats the indices the server just sent, and the
aggregate repeats them again, so two of the three index frames become keys.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from ..jit import REFERENCE, LazyModule, Reusable, compiled
from . import reference

# CodecError is defined with the codec's numpy reference (psparse/ops/codec/reference.py, which
# raises it too), the lowest layer that raises it; the package imports it from here
from .reference import CodecError  # noqa: F401, I001

codec_kernels = LazyModule("psparse.ops.codec.codec_kernels")

FORMATS = ("raw", "delta", "bitmap", "cached")
_MAX_VARINT_BYTES = 10  # a 64-bit gap needs at most 10 groups of 7 bits
assert sys.byteorder == "little", "the bitmap kernels read frames as little-endian words"
# decoded index frames: a server holds each rank's until its next push (the message, then the
# key cache), so about two per rank are in use at once
_DECODED = Reusable(keep=48)



def set_key(indices: np.ndarray) -> bytes:
    """8-byte key of an index set (of its int64 values, whatever dtype they came in)."""
    # hashed in place: an int64 array is not copied (an int32 one is widened once)
    return hashlib.blake2b(memoryview(np.ascontiguousarray(indices, dtype="<i8")),
                           digest_size=8).digest()


def _as_index_array(indices) -> np.ndarray:
    """A contiguous int32/int64 view of ``indices`` (no copy when it already is one)."""
    indices = np.ascontiguousarray(indices)
    if indices.dtype not in (np.int32, np.int64):
        indices = indices.astype(np.int64)
    return indices


def delta_size(indices: np.ndarray) -> int:
    """Bytes of the delta form of a sorted set (one pass, nothing allocated)."""
    indices = _as_index_array(indices)
    if not compiled(indices.size):  # jit.SMALL: the same bytes without loading numba
        return reference.delta_size(indices)
    return int(codec_kernels.delta_size(indices))


def encode_delta(indices: np.ndarray) -> np.ndarray:
    indices = _as_index_array(indices)
    return _encode_delta_within(indices, _MAX_VARINT_BYTES * indices.size)


def _encode_delta_within(indices: np.ndarray, capacity: int) -> np.ndarray | None:
    """The delta frame (a view of a buffer of ``capacity`` + slack bytes), or None when it
    needs more than ``capacity`` bytes: encoding stops there, having cost no more than the
    bytes it wrote."""
    if not compiled(indices.size):
        frame = reference.encode_delta(indices)
        return None if frame.size > capacity else frame
    out = np.empty(capacity + codec_kernels.ENCODE_SLACK, dtype=np.uint8)
    size = codec_kernels.encode_delta(indices, out, capacity)
    return None if size < 0 else out[:size]


def decode_delta(data: np.ndarray, count: int, dtype=np.int64) -> np.ndarray:
    """Indices (of ``dtype``, int32 or int64) from a delta frame; refuses a frame that does not
    hold exactly ``count`` strictly increasing indices below 2^63 (so the result needs no
    sortedness check). One pass over the frame (codec_kernels.decode_delta), the problems
    reported in the order the protocol names them. int32 indices above 2^31 - 1 come back as
    int64 (the caller's range check refuses them)."""
    data = np.ascontiguousarray(data)  # the kernel's checks read 64-byte windows (no copy if so)
    if data.size == 0:
        if count:
            raise CodecError(f"delta frame is empty but count is {count}")
        return np.empty(0, dtype=dtype)
    if data[-1] & 0x80:
        raise CodecError("delta frame ends inside a varint")
    dtype = np.dtype(dtype)
    if not compiled(data.size):
        small = _decode_delta_small(data, count, dtype)
        if small is not None:
            return small
    out = _DECODED.take(data.size + 1, dtype)  # at most one varint per byte
    varints, flags, last = codec_kernels.decode_delta(data, count, out,
                                                      35 if dtype == np.int32 else 63)
    if flags & codec_kernels.WIDE or (dtype == np.int32 and not 0 <= last < 2**31):
        # int32 output: no gap reached 2^35 (so nothing wrapped and the last index is the
        # largest), or decode again as int64 for an exact answer
        return decode_delta(data, count, np.int64)
    if varints != count:
        raise CodecError(f"delta frame holds {varints} varints, count is {count}")
    if flags & codec_kernels.TOO_LONG:
        raise CodecError("varint longer than 10 bytes")
    if flags & codec_kernels.GROUP_OVERFLOW:
        raise CodecError("delta-encoded indices overflow")  # a gap of 2^64 or more
    if flags & codec_kernels.ZERO_GAP:
        raise CodecError("delta gaps must be positive (indices strictly increasing)")
    if flags & codec_kernels.SUM_OVERFLOW:
        raise CodecError("delta-encoded indices overflow")
    return out[:count]


def _decode_delta_small(data: np.ndarray, count: int, dtype) -> np.ndarray | None:
    """decode_delta by the numpy reference, in the header's dtype as the kernel's; None (the
    kernel decides) for a frame with a varint of more than 7 bytes: only there can a small
    frame's indices reach 2^62, near where the reference's float64 bound on the sum of the
    gaps differs from the kernel's exact one (psparse/ops/codec/reference.py)."""
    ends = np.flatnonzero(data < 0x80)
    if ends.size and int(np.diff(ends, prepend=-1).max()) > 7:
        return None
    indices = reference.decode_delta(data, count)
    if dtype == np.int32 and (not indices.size or indices[-1] < 2**31):
        return indices.astype(np.int32)
    return indices


def encode_bitmap(indices: np.ndarray, numel: int) -> np.ndarray:
    indices = _as_index_array(indices)
    if not compiled(max(indices.size, numel // 8)):
        outside = int(np.count_nonzero((indices < 0) | (indices >= numel)))
        if outside:
            raise IndexError(f"{outside} indices outside [0, {numel}) for a bitmap of the "
                             f"model")
        return reference.encode_bitmap(indices, numel)
    words = np.zeros((numel + 63) // 64, dtype=np.uint64)
    outside = codec_kernels.encode_bitmap(indices, words, numel)
    if outside:
        raise IndexError(f"{outside} indices outside [0, {numel}) for a bitmap of the model")
    return words.view(np.uint8)[:(numel + 7) // 8]


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """Indices from a bitmap frame: strictly increasing and in [0, numel) by construction."""
    if data.size != (numel + 7) // 8:
        raise CodecError(f"bitmap frame is {data.size} bytes, expected {(numel + 7) // 8} "
                         f"for {numel} entries")
    if numel % 8 and int(data[-1]) >> (numel % 8):  # only the last byte has bits past numel
        raise CodecError("bitmap has bits set beyond the model size")
    if not compiled(data.size):
        return reference.decode_bitmap(data, count, numel)
    slots = min(count, numel)  # a count beyond numel cannot match
    out = _DECODED.take(slots, np.int64)
    found = codec_kernels.decode_bitmap(data, slots, out)
    if found != count:
        raise CodecError(f"bitmap holds {found} indices, count is {count}")
    return out[:count]


def _sizes(indices: np.ndarray, numel: int, index_itemsize: int) -> dict:
    """{format: bytes} of a set; delta is sized only where it can win (a varint is at least
    one byte, so not when the bitmap is smaller than one per index)."""
    n = indices.size
    sizes = {"raw": n * index_itemsize, "bitmap": (numel + 7) // 8}
    if n and n <= sizes["bitmap"]:
        sizes["delta"] = delta_size(indices)
    return sizes


def _smallest(sizes: dict) -> str:
    return min(sizes, key=lambda f: (sizes[f], FORMATS.index(f)))


def choose(indices: np.ndarray, numel: int, index_itemsize: int = 4) -> tuple[str, int]:
    """The smallest encoding for this set and its size in bytes (key caching aside)."""
    sizes = _sizes(_as_index_array(indices), numel, index_itemsize)
    fmt = _smallest(sizes)
    return fmt, sizes[fmt]


def encode_smallest(indices: np.ndarray, numel: int,
                    index_itemsize: int = 4) -> tuple[str, np.ndarray]:
    """(format, frame) of the smallest encoding, as ``choose`` picks it, in one pass over the
    indices where delta wins: the delta form is written straight away, and given up as soon
    as it grows past the raw or the bitmap form (ties go to raw, then delta, then bitmap)."""
    indices = _as_index_array(indices)
    n = indices.size
    raw, bitmap = n * index_itemsize, (numel + 7) // 8
    if n and n <= bitmap:
        frame = _encode_delta_within(indices, min(raw - 1, bitmap))
        if frame is not None:
            return "delta", frame
    if raw <= bitmap:
        return "raw", indices
    return "bitmap", encode_bitmap(indices, numel)


class KeyCache:
    """The index sets one connection's two ends both hold: the last sent and last received.

    Keys are computed only when used: a sender compares a set with the two it holds (size and
    ends first, then the entries) and hashes only a match; a receiver hashes its two sets only
    when a key arrives. Hashing every set (about a millisecond per million bytes) would
    otherwise cost each message more than its compact encoding."""

    def __init__(self):
        self._slots: dict[bool, list] = {}  # sent? -> [int64 indices, key or None]

    def remember(self, indices: np.ndarray, sent: bool, key: bytes | None = None,
                 slot: list | None = None) -> None:
        """Hold ``indices`` as the set last sent (or received). A copy, unless the array is
        read-only (a received frame, which nobody can change) or ``slot`` is given: one
        [indices, key] held by every connection a broadcast went to (``shared_slot``), so the
        set is copied, and its key hashed, once for all of them."""
        if slot is not None:
            if key is not None and slot[1] is None:
                slot[1] = key
            self._slots[sent] = slot
        elif not indices.flags.writeable:
            self._slots[sent] = [indices, key]
        else:  # the caller's array may change
            self._slots[sent] = [np.array(indices, dtype=np.int64), key]

    @staticmethod
    def shared_slot(indices: np.ndarray) -> list:
        """A slot for ``remember(..., slot=)``: the set (a copy unless it is read-only) and its
        key, unset."""
        return [indices if not indices.flags.writeable else np.array(indices, dtype=np.int64),
                None]

    def _key(self, slot: list) -> bytes:
        if slot[1] is None:
            slot[1] = set_key(slot[0])
        return slot[1]

    def match(self, indices: np.ndarray) -> bytes | None:
        """The key of a held set equal to ``indices``, or None."""
        n = indices.size
        for slot in self._slots.values():
            held = slot[0]
            if held.size == n and (n == 0 or (held[0] == indices[0] and held[-1] == indices[-1]
                                              and np.array_equal(held, indices))):
                return self._key(slot)
        return None

    @property
    def sets(self) -> dict[bytes, np.ndarray]:
        """{key: indices} of the held sets."""
        return {self._key(slot): slot[0] for slot in self._slots.values()}

    def state(self) -> dict:
        slots = {sent: self._key(slot) for sent, slot in self._slots.items()}
        return {"sets": self.sets, "last_sent": slots.get(True),
                "last_received": slots.get(False)}

    def restore(self, state: dict) -> None:
        self._slots = {sent: [np.asarray(state["sets"][key], dtype=np.int64), key]
                       for sent, key in ((True, state["last_sent"]),
                                         (False, state["last_received"])) if key is not None}

    def lookup(self, key: bytes) -> np.ndarray:
        for slot in self._slots.values():
            if self._key(slot) == key:
                return slot[0]
        raise CodecError("cached index set unknown to the receiver")


if REFERENCE:  # PSPARSE_CPU_KERNELS=numpy: the numpy references instead of the kernels
    from . import reference as _reference

    delta_size, encode_delta = _reference.delta_size, _reference.encode_delta

    def decode_delta(data, count, dtype=np.int64):  # noqa: F811 (int64, as it always was)
        return _reference.decode_delta(data, count)

    encode_bitmap, decode_bitmap = _reference.encode_bitmap, _reference.decode_bitmap

    def encode_smallest(indices, numel, index_itemsize=4):  # noqa: F811 (as it was)
        fmt = _smallest(_sizes(np.asarray(indices), numel, index_itemsize))
        if fmt == "delta":
            return fmt, encode_delta(indices)
        return fmt, indices if fmt == "raw" else encode_bitmap(indices, numel)
