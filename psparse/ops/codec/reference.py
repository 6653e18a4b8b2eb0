"""Index coding and the protocol's frame checks in numpy: the compiled kernels' reference.

Each step as it was written before the kernels (``codec_kernels.py`` beside this file), kept
verbatim in behaviour: the kernels' test oracle (tests/test_cpu_kernels.py, bit for bit), the
path under ``PSPARSE_CPU_KERNELS=numpy`` (psparse/ops/jit.py), and the path for small calls in
a process that has not loaded numba (jit.SMALL; tests/test_small_calls.py). One deliberate
difference, at the edge of the number range: ``decode_delta`` here bounds the indices by a
float64 sum of the gaps (which rounds sums just below 2**63 up to it), the kernel by the exact
integer sum.
"""

from __future__ import annotations

import numpy as np

_MAX_VARINT_BYTES = 10


class CodecError(ValueError):
    """An encoded index frame is malformed; the text says how (raised by the numpy references
    here and by psparse/ops/codec/codec.py, which the rest of the package imports it from)."""


def gaps(indices: np.ndarray) -> np.ndarray:
    out = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        out[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=out[1:], dtype=np.int64, casting="unsafe")
    return out


def varint_lengths(g: np.ndarray) -> np.ndarray:
    n = np.ones(g.size, dtype=np.uint8)
    top = int(g.max(initial=0))
    for j in range(1, _MAX_VARINT_BYTES):
        if top < (1 << (7 * j)):
            break
        n += g >= np.uint64(1 << (7 * j))
    return n


def delta_frame(g: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    longest = int(lengths.max(initial=0))
    if longest <= 1:
        return g.astype(np.uint8)
    table = np.empty((g.size, longest), dtype=np.uint8)
    present = np.empty((g.size, longest), dtype=bool)
    for j in range(longest):
        np.greater(lengths, j, out=present[:, j])
        group = (g >> np.uint64(7 * j)).astype(np.uint8) & np.uint8(0x7F)
        np.bitwise_or(group, (lengths > j + 1).view(np.uint8) << np.uint8(7), out=table[:, j])
    return np.compress(present.ravel(), table.ravel())


def encode_delta(indices: np.ndarray) -> np.ndarray:
    g = gaps(indices)
    return delta_frame(g, varint_lengths(g))


def decode_delta(data: np.ndarray, count: int) -> np.ndarray:
    if data.size == 0:
        if count:
            raise CodecError(f"delta frame is empty but count is {count}")
        return np.empty(0, dtype=np.int64)
    if data[-1] & 0x80:
        raise CodecError("delta frame ends inside a varint")
    ends = np.flatnonzero(data < 0x80)
    if ends.size != count:
        raise CodecError(f"delta frame holds {ends.size} varints, count is {count}")
    if ends.size == data.size:
        g = data.astype(np.uint64)
    else:
        starts = np.empty_like(ends)
        starts[0] = 0
        np.add(ends[:-1], 1, out=starts[1:])
        lengths = ends - starts + 1
        longest = int(lengths.max())
        if longest > _MAX_VARINT_BYTES:
            raise CodecError("varint longer than 10 bytes")
        g = (data[starts] & 0x7F).astype(np.uint64)
        for j in range(1, longest):
            at = np.flatnonzero(lengths > j)
            group = data[starts[at] + j] & 0x7F
            if j == _MAX_VARINT_BYTES - 1 and group.max() > 1:
                raise CodecError("delta-encoded indices overflow")
            g[at] |= group.astype(np.uint64) << np.uint64(7 * j)
    if count > 1 and np.count_nonzero(g[1:]) != count - 1:
        raise CodecError("delta gaps must be positive (indices strictly increasing)")
    if g.sum(dtype=np.float64) >= 2**63:
        raise CodecError("delta-encoded indices overflow")
    return np.cumsum(g).view(np.int64)


def encode_bitmap(indices: np.ndarray, numel: int) -> np.ndarray:
    mask = np.zeros(numel, dtype=bool)
    mask[indices] = True
    return np.packbits(mask, bitorder="little")


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    if data.size != (numel + 7) // 8:
        raise CodecError(f"bitmap frame is {data.size} bytes, expected {(numel + 7) // 8} "
                         f"for {numel} entries")
    if numel % 8 and int(data[-1]) >> (numel % 8):
        raise CodecError("bitmap has bits set beyond the model size")
    indices = np.flatnonzero(np.unpackbits(data, count=numel, bitorder="little"))
    if indices.size != count:
        raise CodecError(f"bitmap holds {indices.size} indices, count is {count}")
    return indices


def delta_size(indices: np.ndarray) -> int:
    """Bytes of the delta form (codec_kernels.delta_size's reference)."""
    return int(varint_lengths(gaps(indices)).sum(dtype=np.int64))


# ------------------------------------------------------------------------- frame checks
def sparse_frame_problem(indices: np.ndarray, values, numel, check_order: bool):
    """protocol._decode_sparse's checks of a received sparse frame: the first problem's text,
    or None (codec_kernels.check_sparse's reference)."""
    if indices.size == 0:
        return None
    if check_order:
        if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
            return "indices must be strictly increasing (sorted, no duplicates)"
        if indices[0] < 0:
            return f"index {int(indices[0])} is negative"
    if numel is not None and indices[-1] >= numel:
        return f"index {int(indices[-1])} out of range [0, {numel})"
    if values is not None and not all_finite(values):
        return "values contain NaN or Inf"
    return None


def all_finite(values: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        if values.size == 0 or np.isfinite(np.dot(values, values)):
            return True
    return bool(np.isfinite(values).all())
