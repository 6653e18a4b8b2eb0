"""Value formats (--values): coding, its error bounds, error feedback at both ends, real runs."""

from __future__ import annotations

import json
import math

import msgpack
import numpy as np
import pytest
from conftest import read_jsonl, run_launch

from psparse.ops.codec.codec import KeyCache
from psparse.ops.values import quantize, value_kernels
from psparse.ops.values.formats import FORMATS, ValueFormat, unpack
from psparse.policies.memory import Memory
from psparse.server.aggregation import BroadcastMemory
from psparse.wire import protocol
from psparse.worker.frames import push_frames

ROUNDED = [name for name in FORMATS if name != "fp32"]


def awkward_values(n: int, seed: int = 0) -> np.ndarray:
    """Values over 60 binades, with zeros, a signed zero, a subnormal and huge ones."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    if n > 8:
        v[:6] = [0.0, -0.0, 1e-42, 3e38, -2e38, 70000.0]
    return v


def bound(fmt: ValueFormat, v: np.ndarray) -> np.ndarray:
    """The largest error each value may get: half a step of its format (fp16 and the block
    formats clip what is beyond their range, so those values are left out: inf)."""
    a = np.abs(v.astype(np.float64))
    if fmt.dtype == "bfloat16":
        return np.maximum(a * 2.0 ** -8, 2.0 ** -133)
    if fmt.dtype == "float16":
        return np.where(a > 65504, np.inf, np.maximum(a * 2.0 ** -11, 2.0 ** -25))
    scales, _ = quantize.block_codes(v, fmt.block, fmt.dtype)
    step = np.repeat(scales.astype(np.float64), fmt.block)[:v.size]
    return np.where(a > quantize.BLOCK_CLIP, np.inf, step / 2)


@pytest.mark.parametrize("name", ROUNDED)
@pytest.mark.parametrize("n", [0, 1, 7, 129, 20_001], ids=lambda n: f"n{n}")
def test_each_format_round_trips_within_its_bound_and_is_idempotent(name, n):
    fmt = ValueFormat.named(name, 64)
    v = awkward_values(n)
    frame = fmt.pack(v)
    assert frame.nbytes == fmt.frame_bytes(n)
    got = unpack(frame, fmt.dtype, n, fmt.block)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    assert np.all(np.abs(got.astype(np.float64) - v) <= bound(fmt, v))
    # decoded values encode to the very same frame: what a sender rounds is what goes out
    assert np.array_equal(fmt.pack(got), frame)
    assert np.array_equal(fmt.round(got).view(np.uint32), got.view(np.uint32))


def test_the_kernels_equal_the_numpy_reference_bit_for_bit():
    v = awkward_values(50_000, seed=3)
    for name, block in (("int8", 128), ("int4", 128), ("int8", 1), ("int4", 333)):
        qmax, qbits = quantize.QMAX[name], quantize.QBITS[name]
        scales = np.empty(-(-v.size // block), np.float32)
        codes = np.empty(v.size, np.int8) if name == "int8" else \
            np.empty((v.size + 1) // 2, np.uint8)
        value_kernels.encode_blocks(v, block, qmax, qbits, name == "int4", scales, codes)
        ref_scales, ref_codes = quantize.block_codes(v, block, name)
        assert np.array_equal(scales.view(np.uint32), ref_scales.view(np.uint32)), name
        packed = quantize.pack_nibbles(ref_codes) if name == "int4" else ref_codes
        assert np.array_equal(codes.view(np.uint8), packed.view(np.uint8)), name
        out = np.empty(v.size, np.float32)
        value_kernels.decode_blocks(scales, codes, block, name == "int4", v.size, out)
        ref = quantize.block_values(ref_scales, quantize.unpack_nibbles(packed, v.size)
                                    if name == "int4" else ref_codes, block)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), name
    bf = np.empty(v.size, np.uint16)
    value_kernels.encode_bf16(v, bf)
    assert np.array_equal(bf, quantize.bf16_codes(v))
    out = np.empty(v.size, np.float32)
    value_kernels.decode_bf16(bf, out)
    assert np.array_equal(out.view(np.uint32), quantize.bf16_values(bf).view(np.uint32))
    # fp16: every code decodes as numpy's cast does; values at, beside and between every
    # finite fp16 (the rounding boundaries), past the clip, and the awkward ones encode as
    # numpy's clip-then-cast
    every = np.arange(65536, dtype=np.uint16)
    out = np.empty(every.size, np.float32)
    value_kernels.decode_fp16(every, out)
    assert np.array_equal(out.view(np.uint32), every.view(np.float16).astype(np.float32)
                          .view(np.uint32))
    half = np.sort(out[np.isfinite(out)].astype(np.float64))
    probes = np.concatenate([v, half, np.nextafter(half.astype(np.float32), np.float32(np.inf)),
                             np.nextafter(half.astype(np.float32), np.float32(-np.inf)),
                             (half[:-1] + half[1:]) / 2, [65519.0, 65520.0, 1e30, -1e30]])
    probes = probes.astype(np.float32)
    fp = np.empty(probes.size, np.uint16)
    value_kernels.encode_fp16(probes, fp)
    assert np.array_equal(fp, quantize.fp16_codes(probes).view(np.uint16))


@pytest.mark.parametrize("name", FORMATS)
def test_pack_and_unpack_into_given_buffers_write_the_same_bytes(name):
    """``out=``: a frame and values written into reused buffers (stale bytes in them) equal
    new ones; a buffer of the wrong size or dtype is refused naming it."""
    fmt = ValueFormat.named(name)
    v = awkward_values(5_001, seed=4)
    frame = np.full(fmt.frame_bytes(v.size), 0xAB, np.uint8)
    got = fmt.pack(v, out=frame)
    assert got is frame and np.array_equal(frame, np.asarray(fmt.pack(v)).view(np.uint8))
    values = np.full(v.size, np.nan, np.float32)
    decoded = unpack(frame, fmt.dtype, v.size, fmt.block, out=values)
    assert decoded is values
    assert np.array_equal(values.view(np.uint32),
                          unpack(frame, fmt.dtype, v.size, fmt.block).view(np.uint32))
    with pytest.raises(ValueError, match="out must be a writeable contiguous uint8 array"):
        fmt.pack(v, out=np.empty(frame.size + 1, np.uint8))
    with pytest.raises(ValueError, match="out must be a writeable contiguous float32 array"):
        unpack(frame, fmt.dtype, v.size, fmt.block, out=np.empty(v.size, np.float64))


def test_block_scales_are_the_smallest_power_of_two_that_holds_the_block():
    v = np.array([7.0, 7.5, -3.0, 0.0, 1e-40], np.float32)
    scales, codes = quantize.block_codes(v, 1, "int4")
    # 7 fits 7 x 2^0; 7.5 needs 2^1 (code 4: 7.5 / 2 = 3.75 rounds up); 3 fits 7 x 2^-1
    # (code 6); 0 and a subnormal get the smallest normal scale 2^-126
    assert scales.tolist() == [1.0, 2.0, 0.5, 2.0 ** -126, 2.0 ** -126]
    assert codes.tolist() == [7, 4, -6, 0, 0]


@pytest.mark.parametrize("memory", ["residual", "dgc", "scalecom"])
@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_the_push_rounding_error_is_fed_back_exactly(memory, name, dense):
    numel, k = 4000, 3500 if dense else 300
    fmt = ValueFormat.named(name)
    mem = Memory(numel, memory, momentum=0.9, beta=0.25)
    grad = awkward_values(numel, seed=1) * np.float32(1e-25)  # finite sums of squares
    acc = mem.add(grad).copy()
    filtered_before = None if mem.filtered is None else mem.filtered.copy()
    indices = np.sort(np.argsort(-np.abs(acc))[:k]).astype(np.int64)
    values = mem.take(indices)
    after_take = mem.state_dict()[("filtered" if memory == "scalecom" else "accumulator")].copy()
    frames = push_frames(0, 0, indices, values, numel, KeyCache(), None, None,
                         value_format=fmt, feedback=mem.feed_back)
    msg = protocol.decode(frames, numel=numel, cache=KeyCache())
    assert bool(msg.get("dense")) == dense
    received = msg.values[indices] if dense else msg.values
    assert np.array_equal(msg.indices, indices) if not dense else True
    error = values - received
    if memory == "scalecom":
        # m_{t+1} = (1 - beta) m_t + beta (p_t - s_t): the error is part of what was not sent
        expected = after_take.copy()
        expected[indices] += np.float32(0.25) * error
        assert np.array_equal(mem.filtered, expected)
        assert filtered_before is not None
    else:
        # what stays in the accumulator is the value minus what the server received for it
        assert np.array_equal(mem.accumulator[indices], acc[indices] - received)
        untouched = np.setdiff1d(np.arange(numel), indices)
        assert np.array_equal(mem.accumulator[untouched], after_take[untouched])
    assert np.any(error != 0)  # the format did round


def test_the_servers_memory_keeps_what_its_broadcasts_did_not_send():
    rng = np.random.default_rng(2)
    numel = 5000
    memory = BroadcastMemory(numel, ValueFormat.named("int4", 32))
    total = np.zeros(numel, np.float64)
    sent = np.zeros(numel, np.float64)
    for r in range(30):
        idx = np.sort(rng.choice(numel, 400, replace=False))
        mean = rng.standard_normal(400).astype(np.float32)
        total[idx] += mean
        if r % 3 == 2:  # a dense broadcast: rounded in the dense frame's layout
            vector = np.zeros(numel, np.float32)
            vector[idx] = mean
            out = memory.dense(idx, mean, vector)
            assert np.count_nonzero(out[np.setdiff1d(np.arange(numel), idx)]) == 0
            sent += out
        else:
            sent[idx] += memory.sparse(idx, mean)
    # sum of the means = sum of the broadcasts + the memory (to float32 rounding of the sums)
    assert np.allclose(total, sent + memory.residual, atol=1e-4)
    dropped = BroadcastMemory(numel, ValueFormat.named("int4", 32), keep=False)
    assert dropped.residual is None and dropped.state()["support"].size == 0


def _int8_push(values_frame: bytes, **header) -> list:
    idx = np.array([1, 5, 9, 20, 30], np.int32)
    head = {"v": protocol.PROTOCOL_VERSION, "type": "push", "iter": 0, "rank": 0, "count": 5,
            "index_dtype": "int32", "value_dtype": "int8", "value_block": 4, **header}
    return [msgpack.packb({k: v for k, v in head.items() if v is not None}), idx.tobytes(),
            values_frame]


CODES = np.array([1, -2, 3, 4, 5], np.int8).tobytes()
HOSTILE = [
    ("one scale for two blocks", _int8_push(np.float32([0.5]).tobytes() + CODES),
     "int8 value frame is 9 bytes, expected 13"),
    ("an over-long value frame", _int8_push(np.float32([0.5, 1]).tobytes() + CODES + b"x"),
     "expected 13"),
    ("a NaN scale", _int8_push(np.float32([0.5, math.nan]).tobytes() + CODES),
     "scale that is negative, NaN or infinite"),
    ("a negative scale", _int8_push(np.float32([-0.5, 1]).tobytes() + CODES),
     "scale that is negative"),
    ("a product past float32", _int8_push(np.float32([3e38, 1]).tobytes() + CODES),
     "values contain NaN or Inf"),
    ("int8 without value_block", _int8_push(np.float32([0.5, 1]).tobytes() + CODES,
                                            value_block=None), "need the header field"),
    ("value_block with float32", _int8_push(np.float32([1, 2, 3, 4, 5]).tobytes(),
                                            value_dtype="float32"), "value_block is for int8"),
    ("a zero value_block", _int8_push(CODES, value_block=0), r"value_block must be in \[1, "),
    # (a block of 2^40 or 2^63 would have the decoder repeat each scale that many times)
    ("a value_block of 2^40", _int8_push(CODES, value_block=2 ** 40), "got 1099511627776"),
    ("a value_block of 2^63", _int8_push(CODES, value_block=2 ** 63), r"must be in \[1, 1048576"),
    ("an unknown format", _int8_push(CODES, value_dtype="int2"), "value_dtype 'int2'"),
    ("a bf16 frame of odd length", _int8_push(b"\x00" * 9, value_dtype="bfloat16",
                                              value_block=None), "expected 10"),
]


@pytest.mark.parametrize("frames,problem", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_value_frames_are_refused_naming_the_problem(frames, problem):
    with pytest.raises(protocol.ProtocolError, match=problem):
        protocol.decode(frames, numel=100)


def test_a_foreign_int8_frame_with_any_finite_scale_decodes():
    frames = _int8_push(np.float32([0.3, 0.1]).tobytes() + CODES)
    msg = protocol.decode(frames, numel=100)
    assert msg.values.tolist() == pytest.approx([0.3, -0.6, 0.9, 1.2, 0.5], rel=1e-6)
    assert msg.extra["value_bytes"] == 13


def test_a_minus_zero_scale_and_an_unused_int4_nibble_are_accepted_as_the_spec_says():
    """docs/protocol.md, Value formats: -0.0 is a scale >= 0 (its block decodes to zeros), and
    the high nibble of an odd int4 frame's last byte is ignored whatever it holds."""
    frames = _int8_push(np.float32([-0.0, 0.5]).tobytes() + CODES)
    assert protocol.decode(frames, numel=100).values.tolist() == [0, 0, 0, 0, 2.5]
    packed = bytes([0x21, 0x43, 0xF5])  # codes 1, 2, 3, 4, 5 and a stray nibble 0xF
    frames = _int8_push(np.float32([1, 1]).tobytes() + packed, value_dtype="int4")
    assert protocol.decode(frames, numel=100).values.tolist() == [1, 2, 3, 4, 5]


def test_float32_frames_are_todays_bytes():
    idx, val = np.array([3, 9], np.int32), np.float32([1.5, -2])
    frames = protocol.encode("push", idx, val, model_size=100, iter=0, rank=0)
    header = msgpack.unpackb(frames[0])
    assert header["value_dtype"] == "float32" and "value_block" not in header
    assert bytes(memoryview(frames[2]).cast("B")) == val.tobytes()


RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "60",
       "--eval-every", "0", "--check-every", "1", "--seed", "2", "--quiet"]


def launch(out, *extra):
    r = run_launch("--out", str(out), *RUN, *extra, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "summary.json").read_text()), read_jsonl(out / "metrics.jsonl")


@pytest.mark.parametrize("extra", [
    ["--values", "int8", "--policy", "vote", "--policy-arg", "keep=1.5"],
    ["--values", "bf16", "--servers", "2", "--density", "0.3"],  # dense pushes at bf16 too
    ["--values", "int4", "--granularity", "layer", "--overlap"],
], ids=["vote-int8", "bf16-shards-dense", "int4-overlap"])
def test_runs_in_every_format_keep_replicas_identical_and_count_real_bytes(tmp_path, extra):
    summary, metrics = launch(tmp_path / "run", *extra)
    # --check-every 1: the server compared every rank's weights after every round
    assert summary["status"] == "ok"
    name = extra[1]
    assert summary["values"]["format"] == name and summary["values"]["broadcast_memory"]
    for m in metrics:
        assert 0 < m["upload_value_bytes"] < m["upload_bytes"]
        assert 0 < m["broadcast_value_bytes"] < m["broadcast_bytes"]
    if "--servers" in extra:
        assert any(m["dense"] for m in metrics)
    if name == "int8":  # one byte per value, a 4-byte scale per 128 values, per push
        pushes = sum(-(-k // 128) * 4 + k for k in metrics[0]["k"])
        proposals = metrics[0]["proposals"]
        assert metrics[0]["upload_value_bytes"] == pushes + sum(
            -(-p // 128) * 4 + p for p in proposals)


def test_a_format_halves_the_value_bytes_and_the_run_is_reproducible(tmp_path):
    fp32, m32 = launch(tmp_path / "fp32")
    bf16, m16 = launch(tmp_path / "bf16", "--values", "bf16")
    again, m16b = launch(tmp_path / "bf16-again", "--values", "bf16")
    assert "values" not in fp32
    # every push's values at 2 bytes instead of 4 (the same k: one-phase top-k)
    for a, b in zip(m32, m16):
        assert b["upload_value_bytes"] * 2 == a["upload_value_bytes"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("round_s", "time_s")}  # noqa: E731
                          for r in rows]
    assert strip(m16) == strip(m16b) and bf16["test_acc"] == again["test_acc"]


def test_no_broadcast_memory_needs_a_rounded_format(tmp_path):
    r = run_launch("--out", str(tmp_path / "x"), *RUN,
                   "--no-broadcast-memory", timeout=120)
    assert r.returncode == 2 and "no-broadcast-memory is for rounded values" in r.stderr
