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

import numpy as np

FORMATS = ("raw", "delta", "bitmap", "cached")
_MAX_VARINT_BYTES = 10  # a 64-bit gap needs at most 10 groups of 7 bits


class CodecError(ValueError):
    """An encoded index frame is malformed; the text says how."""


def set_key(indices: np.ndarray) -> bytes:
    """8-byte key of an index set (of its int64 values, whatever dtype they came in)."""
    # hashed in place: an int64 array is not copied (an int32 one is widened once)
    return hashlib.blake2b(memoryview(np.ascontiguousarray(indices, dtype="<i8")),
                           digest_size=8).digest()


def _gaps(indices: np.ndarray) -> np.ndarray:
    """The first index, then the gaps to each previous index, as unsigned 64-bit integers."""
    gaps = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:], dtype=np.int64, casting="unsafe")
    return gaps


def varint_lengths(gaps: np.ndarray) -> np.ndarray:
    """Bytes each gap takes as an LEB128 varint (1 to 10)."""
    n = np.ones(gaps.size, dtype=np.uint8)
    top = int(gaps.max(initial=0))
    for j in range(1, _MAX_VARINT_BYTES):
        if top < (1 << (7 * j)):
            break  # no gap needs more groups: skip the remaining passes
        n += gaps >= np.uint64(1 << (7 * j))
    return n


def _delta_frame(gaps: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """LEB128 bytes of ``gaps`` whose lengths are ``lengths``: one (count x longest) byte table,
    row i holding gap i's groups (continuation bit set on all but its last), read out row by
    row where a group exists."""
    longest = int(lengths.max(initial=0))
    if longest <= 1:
        return gaps.astype(np.uint8)  # every gap below 128: one byte each, no high bit
    table = np.empty((gaps.size, longest), dtype=np.uint8)
    present = np.empty((gaps.size, longest), dtype=bool)  # column by column: numpy's
    for j in range(longest):  # broadcasting over a 2-wide inner axis is several times slower
        np.greater(lengths, j, out=present[:, j])
        group = (gaps >> np.uint64(7 * j)).astype(np.uint8) & np.uint8(0x7F)
        np.bitwise_or(group, (lengths > j + 1).view(np.uint8) << np.uint8(7), out=table[:, j])
    return np.compress(present.ravel(), table.ravel())


def encode_delta(indices: np.ndarray) -> np.ndarray:
    gaps = _gaps(indices)
    return _delta_frame(gaps, varint_lengths(gaps))


def decode_delta(data: np.ndarray, count: int) -> np.ndarray:
    """Indices from a delta frame; refuses a frame that does not hold exactly ``count``
    strictly increasing indices below 2^63 (so the result needs no sortedness check)."""
    if data.size == 0:
        if count:
            raise CodecError(f"delta frame is empty but count is {count}")
        return np.empty(0, dtype=np.int64)
    if data[-1] & 0x80:
        raise CodecError("delta frame ends inside a varint")
    ends = np.flatnonzero(data < 0x80)  # the last byte of every varint
    if ends.size != count:
        raise CodecError(f"delta frame holds {ends.size} varints, count is {count}")
    if ends.size == data.size:  # every varint one byte: the gaps are the bytes
        gaps = data.astype(np.uint64)
    else:
        starts = np.empty_like(ends)
        starts[0] = 0
        np.add(ends[:-1], 1, out=starts[1:])
        lengths = ends - starts + 1
        longest = int(lengths.max())
        if longest > _MAX_VARINT_BYTES:
            raise CodecError("varint longer than 10 bytes")
        gaps = (data[starts] & 0x7F).astype(np.uint64)
        for j in range(1, longest):
            at = np.flatnonzero(lengths > j)
            group = data[starts[at] + j] & 0x7F
            if j == _MAX_VARINT_BYTES - 1 and group.max() > 1:
                raise CodecError("delta-encoded indices overflow")  # a gap of 2^64 or more
            gaps[at] |= group.astype(np.uint64) << np.uint64(7 * j)
    if count > 1 and np.count_nonzero(gaps[1:]) != count - 1:
        raise CodecError("delta gaps must be positive (indices strictly increasing)")
    if gaps.sum(dtype=np.float64) >= 2**63:
        raise CodecError("delta-encoded indices overflow")
    return np.cumsum(gaps).view(np.int64)


def encode_bitmap(indices: np.ndarray, numel: int) -> np.ndarray:
    mask = np.zeros(numel, dtype=bool)
    mask[indices] = True
    return np.packbits(mask, bitorder="little")


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """Indices from a bitmap frame: strictly increasing and in [0, numel) by construction."""
    if data.size != (numel + 7) // 8:
        raise CodecError(f"bitmap frame is {data.size} bytes, expected {(numel + 7) // 8} "
                         f"for {numel} entries")
    if numel % 8 and int(data[-1]) >> (numel % 8):  # only the last byte has bits past numel
        raise CodecError("bitmap has bits set beyond the model size")
    indices = np.flatnonzero(np.unpackbits(data, count=numel, bitorder="little"))
    if indices.size != count:
        raise CodecError(f"bitmap holds {indices.size} indices, count is {count}")
    return indices


def _sizes(indices: np.ndarray, numel: int, index_itemsize: int):
    """({format: bytes}, gaps, varint lengths) of a set; delta is sized only where it can win
    (a varint is at least one byte, so not when the bitmap is smaller than one per index)."""
    n = indices.size
    sizes = {"raw": n * index_itemsize, "bitmap": (numel + 7) // 8}
    gaps = lengths = None
    if n and n <= sizes["bitmap"]:
        gaps = _gaps(indices)
        lengths = varint_lengths(gaps)
        sizes["delta"] = int(lengths.sum(dtype=np.int64))
    return sizes, gaps, lengths


def _smallest(sizes: dict) -> str:
    return min(sizes, key=lambda f: (sizes[f], FORMATS.index(f)))


def choose(indices: np.ndarray, numel: int, index_itemsize: int = 4) -> tuple[str, int]:
    """The smallest encoding for this set and its size in bytes (key caching aside)."""
    sizes = _sizes(indices, numel, index_itemsize)[0]
    fmt = _smallest(sizes)
    return fmt, sizes[fmt]


def encode_smallest(indices: np.ndarray, numel: int,
                    index_itemsize: int = 4) -> tuple[str, np.ndarray]:
    """(format, frame) of the smallest encoding, as ``choose`` picks it; the gaps that size the
    delta form are computed once and, when it wins, encoded."""
    sizes, gaps, lengths = _sizes(indices, numel, index_itemsize)
    fmt = _smallest(sizes)
    if fmt == "delta":
        return fmt, _delta_frame(gaps, lengths)
    return fmt, indices if fmt == "raw" else encode_bitmap(indices, numel)


class KeyCache:
    """The index sets one connection's two ends both hold: the last sent and last received.

    Keys are computed only when used: a sender compares a set with the two it holds (size and
    ends first, then the entries) and hashes only a match; a receiver hashes its two sets only
    when a key arrives. Hashing every set (about a millisecond per million bytes) would
    otherwise cost each message more than its compact encoding."""

    def __init__(self):
        self._slots: dict[bool, list] = {}  # sent? -> [int64 indices, key or None]

    def remember(self, indices: np.ndarray, sent: bool, key: bytes | None = None) -> None:
        # a copy: the caller's array may change (or be a view of a received frame)
        self._slots[sent] = [np.array(indices, dtype=np.int64), key]

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
