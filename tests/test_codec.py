"""Index encodings round-trip exactly; malformed frames are refused; key caching on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from psparse.ops.codec import codec
from psparse.ops.codec.codec import CodecError, KeyCache
from psparse.wire import protocol
from psparse.wire.protocol import ProtocolError

NUMEL = 100_000


def sets():
    rng = np.random.default_rng(0)
    yield "empty", np.empty(0, np.int64)
    yield "zero", np.array([0])
    yield "last", np.array([NUMEL - 1])
    yield "ends", np.array([0, NUMEL - 1])
    yield "run", np.arange(5000, 9000)
    yield "all", np.arange(NUMEL)
    yield "random-small", np.sort(rng.choice(NUMEL, 50, replace=False))
    yield "random-big", np.sort(rng.choice(NUMEL, 30_000, replace=False))
    yield "clustered", np.unique(np.concatenate([np.arange(s, s + 40) for s in
                                                 rng.choice(NUMEL - 40, 100)]))
    yield "gaps-at-varint-edges", np.cumsum([0, 127, 128, 16383, 16384, 1, 2**14 - 1])


@pytest.mark.parametrize("name, idx", list(sets()), ids=[n for n, _ in sets()])
def test_every_encoding_round_trips(name, idx):
    delta = codec.encode_delta(idx)
    np.testing.assert_array_equal(codec.decode_delta(delta, idx.size), idx)
    bitmap = codec.encode_bitmap(idx, NUMEL)
    assert bitmap.size == (NUMEL + 7) // 8
    np.testing.assert_array_equal(codec.decode_bitmap(bitmap, idx.size, NUMEL), idx)
    fmt, size = codec.choose(idx, NUMEL)
    sizes = {"raw": idx.size * 4, "bitmap": bitmap.size, "delta": delta.size}
    assert size == min(sizes.values()) and sizes[fmt] == size
    # and through the protocol, with values
    vals = np.arange(idx.size, dtype=np.float32)
    frames = protocol.encode("push", idx.astype(np.int32), vals, model_size=NUMEL, iter=0,
                             rank=0)
    frames = [f if isinstance(f, bytes) else memoryview(f).cast("B").tobytes() for f in frames]
    msg = protocol.decode(frames, numel=NUMEL)
    np.testing.assert_array_equal(msg.indices, idx)
    np.testing.assert_array_equal(msg.values, vals)


def test_large_int64_gaps_round_trip():
    idx = np.array([3, 2**40, 2**62 + 5], dtype=np.int64)
    np.testing.assert_array_equal(codec.decode_delta(codec.encode_delta(idx), 3), idx)


def test_chooser_prefers_the_compact_forms_where_they_win():
    assert codec.choose(np.arange(1000, 3000), NUMEL)[0] == "delta"  # gaps of 1: 1 byte each
    assert codec.choose(np.arange(0, NUMEL, 2), NUMEL)[0] == "bitmap"
    spread = np.arange(0, 2**31 - 1, 3 * 10**8)  # gaps >= 2^28: 5-byte varints
    assert codec.choose(spread, 2**31 - 1)[0] == "raw"


def _push(header_changes, frame, count):
    h = {"v": protocol.PROTOCOL_VERSION, "type": "push", "iter": 0, "rank": 0, "count": count,
         "index_dtype": "int32", "value_dtype": "float32", **header_changes}
    import msgpack

    return [msgpack.packb(h), frame, np.zeros(count, np.float32).tobytes()]


@pytest.mark.parametrize("changes, frame, count, reason", [
    ({"index_format": "delta"}, bytes([5, 0x81]), 2, "ends inside a varint"),
    ({"index_format": "delta"}, bytes([5, 1, 1]), 2, "holds 3 varints, count is 2"),
    ({"index_format": "delta"}, bytes([0x80] * 10 + [1]), 1, "longer than 10 bytes"),
    ({"index_format": "delta"}, bytes([5, 0]), 2, "gaps must be positive"),
    ({"index_format": "delta"}, bytes([0xFF, 0xFF, 0x7F]), 1, "out of range"),
    ({"index_format": "bitmap"}, bytes(10), 0, "bitmap frame is 10 bytes"),
    ({"index_format": "bitmap"}, bytes([1]) + bytes(12499), 2, "holds 1 indices, count is 2"),
    ({"index_format": "cached"}, bytes(8), 3, "without a key cache"),
    ({"index_format": "zip"}, b"", 0, "index_format 'zip' unknown"),
])
def test_malformed_encoded_frames_are_refused(changes, frame, count, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(_push(changes, frame, count), numel=NUMEL)


def test_bitmap_bits_beyond_the_model_are_refused():
    frame = np.zeros(2, np.uint8)
    frame[1] = 0x80  # bit 15 of a 10-entry model
    with pytest.raises(ProtocolError, match="beyond the model size"):
        protocol.decode(_push({"index_format": "bitmap"}, frame.tobytes(), 1), numel=10)


def test_key_cache_sends_a_reference_for_a_set_the_receiver_holds():
    sender, receiver = KeyCache(), KeyCache()
    idx = np.array([1, 5, 9, 200], np.int32)
    first = protocol.encode("indices", idx, model_size=NUMEL, cache=sender, iter=0)
    protocol.decode([bytes(memoryview(f).cast("B")) for f in first], numel=NUMEL,
                    cache=receiver)
    again = protocol.encode("push", idx, np.ones(4, np.float32), model_size=NUMEL,
                            cache=receiver, iter=0, rank=0)  # the receiver answers with them
    assert len(again[1]) == 8  # a key, not the indices
    msg = protocol.decode([bytes(memoryview(f).cast("B")) for f in again], numel=NUMEL,
                          cache=sender)
    np.testing.assert_array_equal(msg.indices, idx)
    with pytest.raises(ProtocolError, match="unknown to the receiver"):
        protocol.decode([bytes(memoryview(f).cast("B")) for f in again], numel=NUMEL,
                        cache=KeyCache())


def _leb128(indices) -> bytes:
    """The delta frame as docs/protocol.md defines it, one varint at a time."""
    out, previous = bytearray(), 0
    for i in (int(x) for x in indices):
        gap, previous = i - previous, i
        while True:
            byte, gap = gap & 0x7F, gap >> 7
            out.append(byte | (0x80 if gap else 0))
            if not gap:
                break
    return bytes(out)


@pytest.mark.parametrize("scale", [1, 100, 200, 20_000, 3_000_000, 2**40])
def test_vectorised_delta_codec_matches_the_byte_by_byte_definition(scale):
    rng = np.random.default_rng(scale)
    for n in (1, 2, 7, 1000):
        gaps = rng.integers(1, 2 * scale + 1, n, dtype=np.int64)
        gaps[0] = rng.integers(0, scale + 1)
        idx = np.cumsum(gaps)
        for array in ((idx, idx.astype(np.int32)) if idx[-1] < 2**31 else (idx,)):
            frame = codec.encode_delta(array)
            assert frame.tobytes() == _leb128(idx)
            np.testing.assert_array_equal(codec.decode_delta(frame, n), idx)
            fmt, size = codec.choose(array, 2**62, array.itemsize)
            assert codec.encode_smallest(array, 2**62, array.itemsize)[0] == fmt
            assert size == min(len(frame), n * array.itemsize)


def test_delta_frames_beyond_64_bits_and_overlong_varints():
    ten = bytes([0x80] * 9 + [0x02])  # a 10-byte varint of 2^64: does not fit
    with pytest.raises(CodecError, match="overflow"):
        codec.decode_delta(np.frombuffer(ten, np.uint8), 1)
    top = bytes([0xFF] * 8 + [0xFF, 0x00])  # 2^63 - 1 with an overlong zero tail
    with pytest.raises(CodecError, match="overflow"):
        codec.decode_delta(np.frombuffer(bytes([0x01]) + top, np.uint8), 2)
    # overlong (non-minimal) varints decode to their value, as they always did
    np.testing.assert_array_equal(
        codec.decode_delta(np.frombuffer(bytes([0x85, 0x00, 0x81, 0x80, 0x00]), np.uint8), 2),
        [5, 6])


def test_bitmap_tail_bits_live_in_the_last_byte_only():
    for numel in (8, 16, 13):
        frame = codec.encode_bitmap(np.array([0, numel - 1]), numel)
        np.testing.assert_array_equal(codec.decode_bitmap(frame, 2, numel), [0, numel - 1])
    frame = codec.encode_bitmap(np.array([0]), 13)
    frame[-1] |= 0x20  # bit 13
    with pytest.raises(CodecError, match="beyond the model size"):
        codec.decode_bitmap(frame, 2, 13)


def test_key_cache_hashes_only_what_is_used():
    cache = KeyCache()
    a = np.array([1, 5, 9, 200], np.int32)
    cache.remember(a, sent=True)
    cache.remember(np.array([1, 6, 9, 200]), sent=False)  # same size and ends, other set
    assert all(slot[1] is None for slot in cache._slots.values())  # nothing hashed yet
    assert cache.match(np.array([1, 5, 9, 201])) is None
    assert cache.match(np.array([1, 7, 9, 200])) is None
    assert all(slot[1] is None for slot in cache._slots.values())
    assert cache.match(a.astype(np.int64)) == codec.set_key(a)
    np.testing.assert_array_equal(cache.lookup(codec.set_key([1, 6, 9, 200])),
                                  [1, 6, 9, 200])
    restored = KeyCache()
    restored.restore(cache.state())
    assert restored.sets.keys() == cache.sets.keys()
    assert restored.match(a) == codec.set_key(a)
    a[1] = 4  # the cache holds its own copy
    assert cache.match(np.array([1, 5, 9, 200])) == codec.set_key(np.array([1, 5, 9, 200]))
    empty = KeyCache()
    empty.remember(np.empty(0, np.int64), sent=False)
    assert empty.match(np.empty(0, np.int32)) == codec.set_key(np.empty(0, np.int64))
