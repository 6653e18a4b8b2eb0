"""The device's rounding of a push (--values on the GPU path: psparse/ops/values/values.cu through
psparse/worker/device_values.py), against the host's.

The kernels run through a backend: the CUDA emulator (psparse/backends/kernel_emu.py) in both fiber
orders, and the GPU when there is one (benchmarks/gpu_check.py runs this file there), on an
engine-like selection: segments stored with gaps, counts from a report, the push cut into
frames at key-range edges. Each frame must be the bytes the host's ``ValueFormat.pack`` makes
of the same values, and the memory must gain exactly what the host's ``Memory.feed_back`` adds.
Then whole runs on the strict emulated device (one copy back a round) against the host path.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import read_jsonl

from psparse.backends.cuda import CudaBackend
from psparse.backends.emulated import EmulatedBackend
from psparse.ops.select.radix import RP_W
from psparse.ops.values.formats import ValueFormat, unpack
from psparse.ops.values.quantize import QBITS, QMAX
from psparse.worker.device_values import FORMAT_IDS, LAYOUT_W
from psparse.xp import cupy_or_none


def _backends():
    out = [pytest.param(lambda: EmulatedBackend(strict=False), id="emulated"),
           pytest.param(lambda: EmulatedBackend(strict=False, reverse=True),
                        id="emulated-reversed")]
    if cupy_or_none() is not None:
        out.append(pytest.param(lambda: CudaBackend(cupy_or_none()), id="cuda"))
    return out


@pytest.fixture(scope="module", params=_backends())
def dev(request):
    return request.param()


def selection(rng, wide: bool):
    """An engine-like selection over 200,000 keys: three segments stored from 0, 300 and 700
    with room to spare (capacities 290, 400, 300), their counts in a report; sorted keys;
    values across 60 binades with zeros, a subnormal and values past the block clip."""
    starts, counts = [0, 300, 700], [283, 391, 267]
    capacity = 1000
    keys = np.sort(rng.choice(200_000, sum(counts), replace=False))
    indices = np.full(capacity, -1, np.int64 if wide else np.int32)
    values = np.full(capacity, np.nan, np.float32)  # what lies past a count is never read
    compact = (rng.standard_normal(sum(counts)) *
               np.exp2(rng.uniform(-30, 30, sum(counts)))).astype(np.float32)
    compact[:6] = [0.0, -0.0, 1e-40, -3e38, 2.5e36, 7.0]
    compact[300:428] = 0.0  # a whole block of zeros (frame 1 starts inside it)
    done = 0
    for s, c in zip(starts, counts):
        indices[s:s + c] = keys[done:done + c]
        values[s:s + c] = compact[done:done + c]
        done += c
    report = np.zeros(len(starts) * RP_W, np.int64)
    report[::RP_W] = counts
    return indices, values, np.array(starts, np.int64), report, keys, compact


@pytest.mark.parametrize("name", ["int8", "int4", "bf16", "fp16"])
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("scaled", [False, True], ids=["accumulator", "scalecom"])
def test_frames_and_feedback_equal_the_hosts(dev, name, wide, scaled):
    rng = np.random.default_rng(7)
    up = dev.xp.asarray
    # int8: blocks longer than a CUDA block (256 threads); int4: an odd pair at a frame's end
    fmt = ValueFormat.named(name, {"int8": 300, "int4": 100}.get(name))
    indices, values, starts, report, keys, compact = selection(rng, wide)
    edges = np.array([keys[310], keys[700] + 1], np.int64)  # three frames
    frames = edges.size + 1
    capacity = indices.size
    idx32 = up(indices if not wide else np.zeros(1, np.int32))
    idx64 = up(indices if wide else np.zeros(1, np.int64))
    seg_first = up(np.zeros(starts.size, np.int64))
    layout = up(np.zeros(1 + LAYOUT_W * frames, np.int64))
    fid = np.int32(FORMAT_IDS[fmt.dtype])
    starts_dev = up(starts)
    dev.launch("psparse_value_layout", 1, (
        up(report), np.int32(RP_W), np.int32(1), up(np.zeros(3, np.int64)), starts_dev,
        np.int32(3), idx32, idx64, np.int32(wide), up(edges), np.int32(frames),
        np.int64(fmt.block or 1), fid, seg_first, layout))
    layout_host = dev.read(layout)
    rows = layout_host[1:].reshape(frames, LAYOUT_W)
    cuts = [0, *np.searchsorted(keys, edges).tolist(), keys.size]  # the shards' split
    assert layout_host[0] == keys.size and rows[:, 0].tolist() == cuts[:-1]
    assert rows[:, 1].tolist() == np.diff(cuts).tolist()

    before = rng.standard_normal(200_000).astype(np.float32)
    memory = up(before.copy())  # (np.asarray on the emulator would share it)
    beta = np.float32(0.3)
    where = (idx32, idx64, np.int32(wide), seg_first, starts_dev, np.int32(3))
    tail = (memory, np.int64(before.size), beta if scaled else np.float32(1.0),
            np.int32(scaled))
    if fmt.dtype in ("int8", "int4"):
        blocks = -(-capacity // fmt.block) + frames
        scales = up(np.zeros(blocks, np.float32))
        codes = up(np.zeros(capacity, np.int8))
        dev.launch("psparse_value_blocks", blocks, (
            up(values), *where, layout, np.int32(frames), np.int64(fmt.block),
            np.int32(QMAX[fmt.dtype]), np.int32(QBITS[fmt.dtype]), *tail, scales, codes))
        scales, codes8 = dev.read(scales), dev.read(codes)
        if fmt.dtype == "int4":
            packed = up(np.zeros(capacity // 2 + frames, np.uint8))
            dev.launch("psparse_value_nibbles", 2, (codes, layout, np.int32(frames), packed))
            packed = dev.read(packed)
    else:
        codes16 = up(np.zeros(capacity, np.uint16))
        dev.launch("psparse_value_halves", 2, (up(values), *where, layout, fid, *tail,
                                               codes16))
        codes16 = dev.read(codes16)

    expected = before.copy()
    for first, count, first_block, first_byte in rows.tolist():
        sent = compact[first:first + count]
        want = fmt.pack(sent)
        if fmt.dtype in ("int8", "int4"):
            nbytes = (count + 1) // 2 if fmt.dtype == "int4" else count
            got = np.concatenate([
                scales[first_block:first_block + -(-count // fmt.block)].view(np.uint8),
                (packed[first_byte:first_byte + nbytes] if fmt.dtype == "int4"
                 else codes8[first:first + count].view(np.uint8))])
        else:
            got = codes16[first:first + count].view(np.uint8)
        assert np.array_equal(got, want), f"frame at {first}"
        error = sent - unpack(want, fmt.dtype, count, fmt.block)  # Memory.feed_back's rule
        at = keys[first:first + count]
        expected[at] += beta * error if scaled else error
    assert np.array_equal(dev.read(memory).view(np.uint32), expected.view(np.uint32))


def test_an_index_out_of_range_writes_nothing(dev):
    """A policy's bad index is refused after the copy back (the check kernel's flag); the
    feedback before it must not write past the memory."""
    up = dev.xp.asarray
    indices = up(np.array([3, 5, 9_999], np.int64))
    one = up(np.zeros(1, np.int64))
    layout = up(np.zeros(1 + LAYOUT_W, np.int64))
    seg_first = up(np.zeros(1, np.int64))
    fid = np.int32(FORMAT_IDS["float16"])
    dev.launch("psparse_value_layout", 1, (
        one, np.int32(RP_W), np.int32(0), up(np.array([3], np.int64)), one, np.int32(1),
        up(np.zeros(1, np.int32)), indices, np.int32(1), one, np.int32(1), np.int64(1), fid,
        seg_first, layout))
    memory = up(np.zeros(10, np.float32))
    codes = up(np.zeros(3, np.uint16))
    values = up(np.array([1.0 / 3, -2.25, 1.0 / 3], np.float32))  # 1/3 is not exact in fp16
    dev.launch("psparse_value_halves", 1, (
        values, up(np.zeros(1, np.int32)), indices, np.int32(1), seg_first, one, np.int32(1),
        layout, fid, memory, np.int64(10), np.float32(1), np.int32(0), codes))
    written = dev.read(memory)
    assert dev.read(layout)[0] == 3 and written[3] != 0 and not np.delete(written, 3).any()


@pytest.mark.parametrize("extra,uploads", [
    pytest.param(("--values", "int4", "--servers", "2", "--value-block", "60", "--policy",
                  "cltk", "--memory", "scalecom"), 3.0, marks=pytest.mark.long),
    (("--values", "fp16", "--overlap", "--granularity", "layer"), 2.0),
], ids=["int4-shards-cltk-scalecom", "fp16-parts"])
def test_device_rounding_runs_as_the_host_does(tmp_path, extra, uploads):
    """Whole runs on the strict emulated device, rounding on the device, bit-identical to the
    host path's (metrics every round, weight checksums); the error goes up no more: the
    uploads a round are a float32 run's (the aggregate's indices and values, and a two-phase
    round's group)."""
    from test_device_round import launch, ranks, without_timing
    host = launch(tmp_path / "host", *extra, emulate=None)
    device = launch(tmp_path / "device", *extra)
    assert host.returncode == 0 and device.returncode == 0, host.stderr + device.stderr
    assert without_timing(read_jsonl(tmp_path / "device" / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "host" / "metrics.jsonl"))
    assert [r["checksum"] for r in ranks(tmp_path / "device")] == \
        [r["checksum"] for r in ranks(tmp_path / "host")]
    assert [r["device"]["uploads_per_iteration"] for r in ranks(tmp_path / "device")] == \
        [uploads, uploads]


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_compact_makes_a_variable_selection_contiguous(dev, wide):
    """psparse_compact (a threshold's selection before its bounded copy back): compact
    position p gets the index and value stored for it, segment after segment."""
    rng = np.random.default_rng(2)
    up = dev.xp.asarray
    indices, values, starts, report, keys, compact = selection(rng, wide)
    idx32 = up(indices if not wide else np.zeros(1, np.int32))
    idx64 = up(indices if wide else np.zeros(1, np.int64))
    seg_first = up(np.zeros(3, np.int64))
    layout = up(np.zeros(1 + LAYOUT_W, np.int64))
    starts_dev = up(starts)
    dev.launch("psparse_value_layout", 1, (
        up(report), np.int32(RP_W), np.int32(1), up(np.zeros(3, np.int64)), starts_dev,
        np.int32(3), idx32, idx64, np.int32(wide), up(np.zeros(1, np.int64)), np.int32(1),
        np.int64(1), np.int32(0), seg_first, layout))
    out32 = up(np.zeros(indices.size if not wide else 1, np.int32))
    out64 = up(np.zeros(indices.size if wide else 1, np.int64))
    out_values = up(np.zeros(indices.size, np.float32))
    dev.launch("psparse_compact", 2, (idx32, idx64, np.int32(wide), up(values), seg_first,
                                      starts_dev, np.int32(3), layout, out32, out64,
                                      out_values))
    got = dev.read(out64 if wide else out32)[:keys.size]
    assert dev.read(layout)[0] == keys.size and np.array_equal(got, keys)
    assert np.array_equal(dev.read(out_values)[:keys.size].view(np.uint32),
                          compact.view(np.uint32))
