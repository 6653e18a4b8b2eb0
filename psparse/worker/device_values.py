"""A GPU push's values in the run's format (``--values``), rounded on the device.

With a value format other than float32, ``SelectionCopy`` hands the selection to
``DeviceValues.stage`` before the round's one copy back: the kernels of
``psparse/ops/values/values.cu`` round the selected values where the engine left them, write the
frames' scales and codes, and add what rounding took from each value into the worker's memory (the
accumulator, or ScaleCom's filtered memory times beta: ``Memory.feedback_target``), all on the
device. The copy back then brings the codes instead of float32 values (a quarter of the bytes for
int8), and nothing goes up for the error. The frames are cut per key-range shard on the device (a
shard's int8/int4 blocks start at its first entry, as a shard's own ``push_frames`` would), so the
host only slices them (``RoundedValues``). A selection large enough that a frame could go dense
(SparCML's switch, which the host decides once the count is back) is rounded on the host instead, as
before (``DeviceValues.active``).

Bit for bit the host's rounding (psparse/ops/values/quantize.py): tests/test_device_values.py holds
the kernels to it on the emulator (and on a GPU when there is one), and whole runs on the strict
emulated device to the host path's.
"""

from __future__ import annotations

import numpy as np

from ..ops.select.radix import RP_W
from ..ops.values.formats import ValueFormat
from ..ops.values.quantize import QBITS, QMAX
from ..wire import protocol
from .frames import RoundedValues

FORMAT_IDS = {"bfloat16": 1, "float16": 2, "int8": 3, "int4": 4}  # values.cu's PV_*
LAYOUT_W = 4  # values.cu's PV_W: (first position, count, first block, first code byte)


class DeviceValues:
    """The device rounding of one worker's pushes (see the module docstring)."""

    def __init__(self, ctx, dev):
        self.s, self.dev = ctx, dev
        self._constants: dict = {}  # (what, values) -> the table on the device, built once
        self._scratch: dict = {}  # name -> a device buffer (grown, never shrunk)

    def active(self, capacity: int, part: int) -> bool:
        """Whether this push is rounded on the device: a value format other than float32, a
        memory to feed the error back into, and no frame that could go dense. A selection
        of at most ``capacity`` entries whose count could make some frame's dense form the
        smaller (SparCML's switch, decided on the host once the count is known) keeps the
        host's rounding: the dense layout rounds differently, and the error fed back must
        be that one's, bit for bit."""
        client = self.s.client
        fmt = client.value_format
        if fmt.exact or client.feedback is None:
            return False
        return not any(
            protocol.dense_is_smaller(min(capacity, size), size,
                                      protocol.index_dtype_for(size), fmt)
            for size in self._frame_sizes(part))

    def _frame_sizes(self, part: int) -> list[int]:
        """The key count of each frame's range: the shards', a part's, or the model's."""
        client = self.s.client
        shards = getattr(client, "shards", None)
        if shards is not None:
            return [c.numel for c in shards]
        if client.parts is not None:
            return [int(client.parts[part + 1] - client.parts[part])]
        return [client.numel]

    # ------------------------------------------------------------------------------ tables
    def _constant(self, what: str, values) -> object:
        key = (what, tuple(int(v) for v in values))
        table = self._constants.get(key)
        if table is None:
            table = self.dev.constant(np.asarray(key[1] or (0,), dtype=np.int64))
            self._constants[key] = table
        return table

    def _buffer(self, name: str, size: int, dtype):
        held = self._scratch.get(name)
        if held is None or held.size < size:
            held = self.dev.xp.zeros(max(size, 1024), dtype=dtype)
            self._scratch[name] = held
        return held[:size]

    def frame_edges(self) -> list[int]:
        """The global keys where a push's frames change: a shard's first key (one server,
        or a round in parts there: none)."""
        edges = getattr(self.s.client, "edges", None)
        return [] if edges is None else [int(e) for e in edges[1:-1]]

    # ------------------------------------------------------------------------------- a push
    def compact(self, tag: str, chosen):
        """A variable selection made contiguous on the device (``psparse_compact``): (its
        indices, its values, the device layout whose first entry is its count), each of the
        selection's capacity; nothing is read."""
        dev = self.dev
        cap = chosen.capacity
        wide = np.int32(chosen.indices.dtype == np.int64)
        idx32 = chosen.indices if not wide else dev.or_dummy(None, np.int32)
        idx64 = chosen.indices if wide else dev.or_dummy(None, np.int64)
        seg_first = self._buffer(f"{tag}-compact-first", len(chosen.starts), np.int64)
        layout = self._buffer(f"{tag}-compact-layout", 1 + LAYOUT_W, np.int64)
        starts = self._constant("starts", chosen.starts)
        dev.launch("psparse_value_layout", 1, (
            chosen.report, np.int32(RP_W), np.int32(1), self._constant("counts", chosen.ks),
            starts, np.int32(len(chosen.starts)), idx32, idx64, wide,
            self._constant("edges", []), np.int32(1), np.int64(1), np.int32(0), seg_first,
            layout))
        indices = self._buffer(f"{tag}-compact-idx", cap, chosen.indices.dtype)
        values = self._buffer(f"{tag}-compact-val", cap, np.float32)
        if cap:
            dev.launch_over("psparse_compact", cap, (
                idx32, idx64, wide, chosen.values, seg_first, starts,
                np.int32(len(chosen.starts)), layout,
                indices if not wide else dev.or_dummy(None, np.int32),
                indices if wide else dev.or_dummy(None, np.int64), values))
        return indices, values, layout

    def stage(self, tag: str, indices, values, starts, counts, report=None):
        """Round the selection on the device: ``indices``/``values`` (device arrays, index
        dtype int32 or int64), segment s from ``starts[s]`` holding ``counts[s]`` entries, or
        its count in ``report`` (the engine's, copied back with the round) when given. Returns
        the pairs to add to the round's copy back and a function that makes the push's
        ``RoundedValues`` from the copied-back host buffers."""
        dev, memory = self.dev, self.s.memory
        fmt: ValueFormat = self.s.client.value_format
        fid = FORMAT_IDS[fmt.dtype]
        capacity = int(sum(counts))
        edges = self.frame_edges()
        frames = len(edges) + 1
        wide = np.int32(indices.dtype == np.int64)
        idx32 = indices if not wide else dev.or_dummy(None, np.int32)
        idx64 = indices if wide else dev.or_dummy(None, np.int64)
        starts_dev = self._constant("starts", starts)
        counts_dev = self._constant("counts", counts)
        edges_dev = self._constant("edges", edges)
        nseg = np.int32(len(starts))
        seg_first = self._buffer("seg-first", len(starts), np.int64)
        layout = self._buffer(f"{tag}-layout", 1 + LAYOUT_W * frames, np.int64)
        dev.launch("psparse_value_layout", 1, (
            dev.or_dummy(report, np.int64), np.int32(RP_W), np.int32(report is not None),
            counts_dev, starts_dev, nseg, idx32, idx64, wide, edges_dev, np.int32(frames),
            np.int64(fmt.block or 1), np.int32(fid), seg_first, layout))
        target, beta = memory.feedback_target()  # ScaleCom: m gains beta times the error
        scaled = np.int32(beta != 1)  # (times 1 is exact: the same bits either way)
        numel = np.int64(target.size)
        where = (idx32, idx64, wide, seg_first, starts_dev, nseg)
        layout_host = dev.pinned(f"{tag}-layout", layout.size, np.int64)
        pairs = [(layout, layout_host)]
        if fmt.dtype in ("int8", "int4"):
            blocks = -(-capacity // fmt.block) + frames  # each frame may start a block
            scales = self._buffer(f"{tag}-scales", blocks, np.float32)
            codes = self._buffer(f"{tag}-codes", capacity, np.int8)
            if capacity:
                dev.launch("psparse_value_blocks", blocks, (
                    values, *where, layout, np.int32(frames), np.int64(fmt.block),
                    np.int32(QMAX[fmt.dtype]), np.int32(QBITS[fmt.dtype]), target, numel,
                    beta, scaled, scales, codes))
            if fmt.dtype == "int4":
                packed = self._buffer(f"{tag}-packed", capacity // 2 + frames, np.uint8)
                if capacity:
                    dev.launch_over("psparse_value_nibbles", capacity, (
                        codes, layout, np.int32(frames), packed))
                codes = packed
            scales_host = dev.pinned(f"{tag}-scales", scales.size, np.float32)
            codes_host = dev.pinned(f"{tag}-codes", codes.size, codes.dtype)
            pairs += [(scales, scales_host), (codes, codes_host)]
        else:
            codes = self._buffer(f"{tag}-codes16", capacity, np.uint16)
            if capacity:
                dev.launch_over("psparse_value_halves", capacity, (
                    values, *where, layout, np.int32(fid), target, numel, beta, scaled, codes))
            scales_host = None
            codes_host = dev.pinned(f"{tag}-codes16", codes.size, np.uint16)
            pairs.append((codes, codes_host))

        def rounded() -> RoundedValues:
            rows = layout_host[1:].reshape(frames, LAYOUT_W)
            out, counts_out = [], []
            for first, count, first_block, first_byte in rows.tolist():
                if scales_host is None:  # bf16, fp16: two bytes a value
                    frame = codes_host[first:first + count].view(np.uint8)
                else:
                    nbytes = (count + 1) // 2 if fmt.dtype == "int4" else count
                    frame = np.concatenate([
                        scales_host[first_block:first_block + -(-count // fmt.block)].view(
                            np.uint8),
                        codes_host[first_byte:first_byte + nbytes].view(np.uint8)])
                out.append(frame)
                counts_out.append(count)
            return RoundedValues(out, counts_out)
        return pairs, rounded
