"""Message codec: round trips, and each kind of malformed message is rejected with its reason."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from psparse.wire import protocol
from psparse.wire.protocol import ProtocolError, decode, encode
from psparse.wire.transport import wire_bytes


def _bytes(frames):
    return [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]


def push(idx, val, **kw):
    fields = {"iter": 3, "rank": 1, **kw}
    return _bytes(encode("push", np.asarray(idx, dtype=np.int32),
                         np.asarray(val, dtype=np.float32), **fields))


def test_push_round_trip_keeps_arrays_and_header():
    idx = np.array([0, 5, 17, 99], dtype=np.int32)
    val = np.array([0.5, -1.25, 3.0, 1e-8], dtype=np.float32)
    frames = _bytes(encode("push", idx, val, iter=7, rank=2, loss=0.25, checksum="ab"))
    msg = decode(frames, numel=100)
    assert msg.type == "push" and msg["iter"] == 7 and msg["rank"] == 2
    assert msg["loss"] == 0.25 and msg["checksum"] == "ab" and msg["count"] == 4
    np.testing.assert_array_equal(msg.indices, idx)
    np.testing.assert_array_equal(msg.values, val)
    # raw frames, not msgpack arrays: the header stays small whatever k is
    assert len(frames) == 3 and len(frames[0]) < 200
    assert len(frames[1]) == 16 and len(frames[2]) == 16


def test_int64_indices_and_empty_push_round_trip():
    msg = decode(_bytes(encode("push", np.array([3, 2**33], dtype=np.int64),
                               np.array([1, 2], dtype=np.float32), iter=0, rank=0)))
    assert msg.indices.dtype == np.int64 and msg.indices[1] == 2**33
    empty = decode(push([], []), numel=10)
    assert empty.indices.size == 0 and empty.values.size == 0


@pytest.mark.parametrize("msg_type, fields", [
    ("register", dict(rank=0, world_size=2, checksum="x", start=0, nonce="n", proof="p",
                      run=dict(numel=10, iterations=5, two_phase=False, steps=[[0, 3, 3, 0]],
                               config={"lr": 0.05, "policy_args": ["a=1"], "clip_norm": None}))),
    ("ready", dict(world_size=2, start=0, token="t", heartbeat_s=1.5,
                   run=dict(numel=10, iterations=5, two_phase=False, steps=[[0, 3, 3, 0]],
                            config={}))),
    ("metrics", dict(iter=3, rank=0, report={"test_acc": 0.9}, checksum="c")),
    ("shutdown", dict(ok=True, reason="done")),
    ("error", dict(message="bad")),
])
def test_control_messages_round_trip(msg_type, fields):
    msg = decode(_bytes(encode(msg_type, **fields)))
    assert msg.type == msg_type
    for key, value in fields.items():
        assert msg[key] == value


def test_two_phase_index_messages_round_trip():
    idx = np.array([2, 3, 11], dtype=np.int32)
    frames = _bytes(encode("propose", idx, np.ones(3, np.float32), iter=4, rank=1))
    assert len(frames) == 3
    msg = decode(frames, numel=12)
    assert msg.type == "propose"
    np.testing.assert_array_equal(msg.indices, idx)
    back = decode(_bytes(encode("indices", idx, iter=4)), numel=12)
    assert len(back.indices) == 3 and back.values is None
    np.testing.assert_array_equal(back.indices, idx)
    with pytest.raises(ProtocolError, match="out of range"):
        decode(frames, numel=11)


def test_index_dtype_for_size():
    assert protocol.index_dtype_for(61706) == "int32"
    assert protocol.index_dtype_for(2**31 + 5) == "int64"


def _header(frames):
    return msgpack.unpackb(frames[0])


def _with_header(frames, **changes):
    h = _header(frames)
    for k, v in changes.items():
        if v is ...:
            h.pop(k)
        else:
            h[k] = v
    return [msgpack.packb(h), *frames[1:]]


GOOD = push([1, 4, 9], [0.1, 0.2, 0.3])

MALFORMED = [
    ("empty message", [], "empty message"),
    ("random bytes", [b"\xc1\xff\x00garbage"], "not valid msgpack"),
    ("header not a map", [msgpack.packb([1, 2, 3])], "must be a map"),
    ("oversize header", [b"\x00" * (protocol.MAX_HEADER_BYTES + 1)], "limit"),
    ("wrong version", _with_header(GOOD, v=99), "protocol version 99"),
    ("unknown type", _with_header(GOOD, type="gossip"), "unknown message type 'gossip'"),
    ("missing field", _with_header(GOOD, iter=...), "lacks field 'iter'"),
    ("wrong field type", _with_header(GOOD, rank="one"), "'rank' must be int"),
    ("bool for int", _with_header(GOOD, iter=True), "'iter' must be int"),
    ("unknown field", _with_header(GOOD, colour="red"), "unknown field 'colour'"),
    ("negative iter", _with_header(GOOD, iter=-1), "'iter' is negative"),
    ("NaN loss", _with_header(GOOD, loss=math.nan), "'loss' is not finite"),
    ("frame count", GOOD[:2], "has 2 frames, expected 3"),
    ("count vs bytes", _with_header(GOOD, count=4), "index frame is 12 bytes, expected 4"),
    ("truncated values", [GOOD[0], GOOD[1], GOOD[2][:-2]], "value frame is 10 bytes"),
    ("bad index dtype", _with_header(GOOD, index_dtype="uint8"), "index_dtype 'uint8'"),
    ("bad value dtype", _with_header(GOOD, value_dtype="float64"), "value_dtype 'float64'"),
    ("index out of range", push([1, 4, 10], [1, 2, 3]), "index 10 out of range [0, 10)"),
    ("negative index", push([-3, 4], [1, 2]), "index -3 is negative"),
    ("unsorted indices", push([4, 1], [1, 2]), "strictly increasing"),
    ("duplicate indices", push([4, 4], [1, 2]), "strictly increasing"),
    ("NaN value", push([1, 2], [1, math.nan]), "NaN or Inf"),
    ("Inf value", push([1, 2], [math.inf, 1]), "NaN or Inf"),
    ("count over limit", push(list(range(11)), [1.0] * 11), "exceeds the limit 10"),
]


@pytest.mark.parametrize("name, frames, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_message_is_rejected_naming_the_problem(name, frames, reason):
    with pytest.raises(ProtocolError) as err:
        decode(frames, numel=10)
    assert reason in str(err.value)


def test_good_message_passes_the_same_checks():
    assert decode(GOOD, numel=10).indices.tolist() == [1, 4, 9]


def test_wire_bytes_counts_zmtp_framing():
    # ZMTP 3: 1 flags byte + 1 length byte below 256 bytes, + 8 length bytes from 256 on
    assert wire_bytes([b"x" * 255]) == 257
    assert wire_bytes([b"x" * 256]) == 265
    assert wire_bytes([b"", np.zeros(100, np.float32)]) == 2 + 409


def test_finite_values_of_any_size_pass_and_every_nan_or_inf_is_caught():
    big = np.float32(3e38)  # finite, but the sum of squares the fast check uses overflows
    assert decode(push([1, 2, 3], [big, -big, 1.0]), numel=10).values[0] == big
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 1, 2):
            val = [big, 1.0, -big]
            val[at] = bad
            with pytest.raises(ProtocolError, match="NaN or Inf"):
                decode(push([1, 2, 3], val), numel=10)
    dense = _bytes(encode("push", None, np.array([big, 0, 0], np.float32), dense=True,
                          iter=0, rank=0))
    assert decode(dense, numel=3).values[0] == big
    dense[2] = np.array([big, math.nan, 0], np.float32).tobytes()
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        decode(dense, numel=3)
    assert protocol.all_finite(np.empty(0, np.float32))
