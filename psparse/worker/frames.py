"""The frames of a worker's messages beyond the client's own: a push's frames (sparse or dense,
its values rounded to the run's format with their error handed back), and the merge of S
key-range shards' (or a round's parts') aggregates into one message over the whole vector.
``PSClient`` (psparse/worker/client.py) and ``ShardedClient`` use them; they touch no socket.
"""

from __future__ import annotations

import numpy as np

from ..ops.values.formats import FP32, ValueFormat, unpack
from ..server.aggregation import agg_kernels
from ..wire import protocol


class RoundedValues:
    """A push's values already in the run's value format, their rounding error already fed
    back: one value frame per key-range shard the push goes to, in shard order, with the
    entries each holds (the GPU path rounds on the device: psparse/worker/device_values.py).
    ``push_frames`` sends such a frame as it is."""

    def __init__(self, frames: list[np.ndarray], counts: list[int]):
        self.frames, self.counts = frames, counts

    def shard(self, n: int) -> RoundedValues:
        return RoundedValues([self.frames[n]], [self.counts[n]])


def push_frames(it: int, rank: int, indices: np.ndarray, values: np.ndarray, size: int, cache,
                loss: float | None, checksum: str | None, part: int | None = None,
                dense_buffer: np.ndarray | None = None, overflow: bool = False,
                stop: bool = False, value_format: ValueFormat = FP32,
                feedback=None) -> list:
    """One push's frames: (index, value) pairs over a vector of ``size`` entries (the model, or
    one part of it, ``indices`` local to it), or all ``size`` values when that is smaller
    (SparCML's switch; written into ``dense_buffer`` when given). ``overflow``: this worker's
    gradient is not finite (no entries; docs/protocol.md, Overflow). ``stop``: this rank asks
    to end the run with this round.

    ``value_format``: the values' format on the wire; ``feedback(indices, error)`` then gets
    what rounding took from each value (the value minus what the server decodes, in the
    layout the frame has: an int8 block is consecutive entries of the frame, sparse or
    dense), for the error-feedback memory."""
    header = {"iter": it, "rank": rank}
    if part is not None:
        header["part"] = part
    if stop:
        header["stop"] = True
    if checksum:
        header["checksum"] = checksum
    if loss is not None:
        header["loss"] = loss
    if overflow:
        header["overflow"] = True
    index_dtype = protocol.index_dtype_for(size)
    dense = protocol.dense_is_smaller(indices.size, size, index_dtype, value_format)
    if isinstance(values, RoundedValues):  # rounded on the device, the error fed back there
        if values.counts[0] != indices.size:
            raise AssertionError(f"a rounded frame of {values.counts[0]} values for "
                                 f"{indices.size} indices")
        if not dense:
            return protocol.encode("push", indices.astype(index_dtype, copy=False), None,
                                   model_size=size, cache=cache, value_format=value_format,
                                   value_frame=values.frames[0], **header)
        # dense is smaller: what the frame decodes to is rounded again in the dense layout
        # below, and that second error goes back too (value - decoded in all)
        values = unpack(values.frames[0], value_format.dtype, indices.size, value_format.block)
    if dense:
        dense = dense_buffer if dense_buffer is not None else np.empty(size, dtype=np.float32)
        dense[:] = 0.0
        dense[indices] = values
        frame = None
        if feedback is not None:  # (values at other entries are 0: they round to 0)
            frame, sent = value_format.encode(dense)
            feedback(indices, values - sent[indices])
        return protocol.encode("push", None, dense, dense=True, value_format=value_format,
                               value_frame=frame, **header)
    frame = None
    if feedback is not None:
        values = np.ascontiguousarray(values, dtype=np.float32)
        frame, sent = value_format.encode(values)
        feedback(indices, values - sent)
    return protocol.encode("push", indices.astype(index_dtype, copy=False), values,
                           model_size=size, cache=cache, value_format=value_format,
                           value_frame=frame, **header)


def merge_aggregates(parts: list[protocol.Message], edges: np.ndarray) -> protocol.Message:
    """The S shards' aggregates of one round as one message over the whole vector: global
    indices, concatenated in shard order. If any shard sent its part dense, the merged one is
    dense (every index, zeros where nothing was aggregated), as a single server sends it."""
    header = dict(parts[0].header)
    header["workers"] = min(m["workers"] for m in parts)
    lives = [set(m["live"]) for m in parts if "live" in m.header]
    if lives:  # an elastic run: each shard loses a silent rank on its own, maybe a round apart;
        header["live"] = sorted(set.intersection(*lives))  # a rank any shard lost is lost
    if any(m.get("stop") for m in parts):  # the round's last part (or every shard) says so
        header["stop"] = True
    if any(m.get("overflow") for m in parts):  # one part's overflow skips the whole step
        header["overflow"] = True
    numel = int(edges[-1])
    if any(m.get("dense") for m in parts):
        values = np.zeros(numel, dtype=np.float32)
        for n, m in enumerate(parts):
            lo = int(edges[n])
            if m.get("dense"):
                values[lo:lo + m.values.size] = m.values
            else:
                agg_kernels.shifted_scatter(values, m.indices, m.values, lo)
        header.update(dense=True, count=numel)
        return protocol.Message("aggregate", header, None, values)
    indices = global_indices([m.indices for m in parts], edges)
    values = np.concatenate([m.values for m in parts])
    header.update(count=int(indices.size))
    header.pop("dense", None)
    return protocol.Message("aggregate", header, indices, values)


def global_indices(parts: list[np.ndarray], edges: np.ndarray) -> np.ndarray:
    """Shard-relative index arrays (shard n's first key is edges[n]) as one int64 array of
    global indices, written in one pass per part (``agg_kernels.shifted_copy``)."""
    out = np.empty(sum(p.size for p in parts), dtype=np.int64)
    at = 0
    for n, p in enumerate(parts):
        agg_kernels.shifted_copy(p, 0, p.size, int(edges[n]), out, at)
        at += p.size
    return out
