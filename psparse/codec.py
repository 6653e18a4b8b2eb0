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
    return hashlib.blake2b(np.ascontiguousarray(indices, dtype="<i8").tobytes(),
                           digest_size=8).digest()


def varint_lengths(gaps: np.ndarray) -> np.ndarray:
    n = np.ones(gaps.size, dtype=np.int64)
    top = int(gaps.max(initial=0))
    for j in range(1, _MAX_VARINT_BYTES):
        if top < (1 << (7 * j)):
            break  # no gap needs more groups: skip the remaining passes
        n += gaps >= (1 << (7 * j))
    return n


def encode_delta(indices: np.ndarray) -> np.ndarray:
    gaps = np.diff(indices.astype(np.uint64), prepend=np.uint64(0))
    lengths = varint_lengths(gaps)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(int(lengths.max(initial=0))):
        sel = lengths > j
        group = (gaps[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[sel] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (group | more).astype(np.uint8)
    return out


def decode_delta(data: np.ndarray, count: int) -> np.ndarray:
    if data.size == 0:
        if count:
            raise CodecError(f"delta frame is empty but count is {count}")
        return np.empty(0, dtype=np.int64)
    ends = (data & 0x80) == 0
    if not ends[-1]:
        raise CodecError("delta frame ends inside a varint")
    if int(ends.sum()) != count:
        raise CodecError(f"delta frame holds {int(ends.sum())} varints, count is {count}")
    value_id = np.concatenate([[0], np.cumsum(ends)[:-1]])
    starts = np.concatenate([[0], np.flatnonzero(ends)[:-1] + 1])
    position = np.arange(data.size) - starts[value_id]
    if position.max() >= _MAX_VARINT_BYTES:
        raise CodecError("varint longer than 10 bytes")
    parts = (data & 0x7F).astype(np.uint64) << (7 * position).astype(np.uint64)
    gaps = np.zeros(count, dtype=np.uint64)
    np.add.at(gaps, value_id, parts)
    if count > 1 and not np.all(gaps[1:] > 0):
        raise CodecError("delta gaps must be positive (indices strictly increasing)")
    if gaps.sum(dtype=np.float64) >= 2**63:
        raise CodecError("delta-encoded indices overflow")
    return np.cumsum(gaps).astype(np.int64)


def encode_bitmap(indices: np.ndarray, numel: int) -> np.ndarray:
    mask = np.zeros(numel, dtype=bool)
    mask[indices] = True
    return np.packbits(mask, bitorder="little")


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    if data.size != (numel + 7) // 8:
        raise CodecError(f"bitmap frame is {data.size} bytes, expected {(numel + 7) // 8} "
                         f"for {numel} entries")
    mask = np.unpackbits(data, count=numel, bitorder="little")
    if np.unpackbits(data, bitorder="little")[numel:].any():
        raise CodecError("bitmap has bits set beyond the model size")
    indices = np.flatnonzero(mask)
    if indices.size != count:
        raise CodecError(f"bitmap holds {indices.size} indices, count is {count}")
    return indices


def choose(indices: np.ndarray, numel: int, index_itemsize: int = 4) -> tuple[str, int]:
    """The smallest encoding for this set and its size in bytes (key caching aside)."""
    n = indices.size
    sizes = {"raw": n * index_itemsize, "bitmap": (numel + 7) // 8}
    if n:
        gaps = np.diff(indices.astype(np.uint64), prepend=np.uint64(0))
        sizes["delta"] = int(varint_lengths(gaps).sum())
    fmt = min(sizes, key=lambda f: (sizes[f], FORMATS.index(f)))
    return fmt, sizes[fmt]


class KeyCache:
    """The index sets one connection's two ends both hold: the last sent and last received."""

    def __init__(self):
        self.sets: dict[bytes, np.ndarray] = {}
        self._last_sent: bytes | None = None
        self._last_received: bytes | None = None

    def remember(self, indices: np.ndarray, sent: bool, key: bytes | None = None) -> None:
        key = key or set_key(indices)
        if sent:
            self._last_sent = key
        else:
            self._last_received = key
        self.sets[key] = np.array(indices, dtype=np.int64)
        for stale in [k for k in self.sets if k not in (self._last_sent, self._last_received)]:
            del self.sets[stale]

    def state(self) -> dict:
        return {"sets": dict(self.sets), "last_sent": self._last_sent,
                "last_received": self._last_received}

    def restore(self, state: dict) -> None:
        self.sets = dict(state["sets"])
        self._last_sent, self._last_received = state["last_sent"], state["last_received"]

    def lookup(self, key: bytes) -> np.ndarray:
        if key not in self.sets:
            raise CodecError("cached index set unknown to the receiver")
        return self.sets[key]
