"""Value formats of the wire (``--values``): a value frame's bytes, encoded, decoded, checked.

A sparse or dense message's value frame holds its ``count`` values in the header's
``value_dtype`` (docs/protocol.md, "Value formats"):

========== ============================================================ ===================
format     frame                                                        bytes for n values
========== ============================================================ ===================
float32    little-endian IEEE binary32 (every peer's default)           4 n
bfloat16   the upper 16 bits of each float32, rounded to nearest even   2 n
float16    IEEE binary16 (magnitudes past 65504 clipped to it)          2 n
int8       float32 scale per block of ``value_block`` values, then one  4 ceil(n / B) + n
           signed byte per value: value = code * its block's scale
int4       the same scales, then two 4-bit two's-complement codes per    4 ceil(n / B)
           byte (entry 2i in the low nibble)                            + ceil(n / 2)
========== ============================================================ ===================

``ValueFormat.round`` is what a receiver decodes from what ``pack`` writes: the sender's
error feedback subtracts exactly that (psparse/ops/values/quantize.py says why it is idempotent).
Large calls run the compiled kernels (psparse/ops/values/value_kernels.py), small ones and
``PSPARSE_CPU_KERNELS=numpy`` the numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..jit import REFERENCE, LazyModule, compiled
from . import quantize

value_kernels = LazyModule("psparse.ops.values.value_kernels")

# --values' names -> the wire's value_dtype
FORMATS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8",
           "int4": "int4"}
WIRE_NAMES = {wire: name for name, wire in FORMATS.items()}
BLOCK_FORMATS = ("int8", "int4")
DEFAULT_BLOCK = 128  # values per float32 scale: 3% of an int8 frame, 6% of an int4 one
MAX_BLOCK = 1 << 20


class ValueFrameError(ValueError):
    """A received value frame does not match its header; the text says how."""


def frame_bytes(dtype: str, count: int, block: int | None = None) -> int:
    """Bytes of a value frame of ``count`` values in wire format ``dtype``."""
    if dtype == "float32":
        return 4 * count
    if dtype in ("bfloat16", "float16"):
        return 2 * count
    scales = 4 * (-(-count // block))
    return scales + (count if dtype == "int8" else (count + 1) // 2)


@dataclass(frozen=True)
class ValueFormat:
    """One value format: ``dtype`` (the wire's name) and, for int8/int4, the block size."""

    dtype: str = "float32"
    block: int = DEFAULT_BLOCK

    @classmethod
    def named(cls, name: str, block: int | None = None) -> ValueFormat:
        """From ``--values`` (fp32, bf16, fp16, int8, int4) and ``--value-block``."""
        if name not in FORMATS:
            raise ValueError(f"--values must be one of {', '.join(FORMATS)}, got {name!r}")
        block = DEFAULT_BLOCK if block is None else block
        if not (isinstance(block, int) and 1 <= block <= MAX_BLOCK):
            raise ValueError(f"--value-block must be an int in [1, {MAX_BLOCK}], got {block!r}")
        return cls(FORMATS[name], block)

    @property
    def name(self) -> str:
        return WIRE_NAMES[self.dtype]

    @property
    def exact(self) -> bool:
        """float32: values travel as they are."""
        return self.dtype == "float32"

    def header(self) -> dict:
        """The header fields of a frame in this format (besides ``value_dtype``)."""
        return {"value_block": self.block} if self.dtype in BLOCK_FORMATS else {}

    def frame_bytes(self, count: int) -> int:
        return frame_bytes(self.dtype, count, self.block)

    @property
    def bytes_per_value(self) -> float:
        """A long frame's bytes per value: int8/int4 share a float32 scale per block."""
        scales = 4.0 / self.block if self.dtype in BLOCK_FORMATS else 0.0
        return {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0,
                "int4": 0.5}[self.dtype] + scales

    def pack(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The value frame of float32 ``values``; written into ``out`` when given (a
        contiguous uint8 array of ``frame_bytes(values.size)`` bytes, e.g. reused from an
        earlier push), else a new array (float32: ``values`` itself, or ``out`` filled)."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        if out is not None:
            _check_out(out, self.frame_bytes(values.size), np.uint8, "frame")
        if self.dtype == "float32":
            return values if out is None else _filled(out, values.view(np.uint8))
        fast = not REFERENCE and compiled(values.size)
        if self.dtype in ("bfloat16", "float16"):
            bf16 = self.dtype == "bfloat16"
            if not fast:
                codes = quantize.bf16_codes(values) if bf16 else quantize.fp16_codes(values)
                return _filled(out, codes.view(np.uint8))
            codes = np.empty(values.size, np.uint16) if out is None else out.view(np.uint16)
            (value_kernels.encode_bf16 if bf16 else value_kernels.encode_fp16)(values, codes)
            return codes.view(np.uint8) if out is None else out
        frame = np.empty(self.frame_bytes(values.size), np.uint8) if out is None else out
        blocks = -(-values.size // self.block)
        scales = frame[:4 * blocks].view(np.float32)
        codes = frame[4 * blocks:]
        if not fast:
            s, c = quantize.block_codes(values, self.block, self.dtype)
            scales[:] = s
            codes[:] = quantize.pack_nibbles(c) if self.dtype == "int4" else c.view(np.uint8)
            return frame
        value_kernels.encode_blocks(values, self.block, quantize.QMAX[self.dtype],
                                    quantize.QBITS[self.dtype], self.dtype == "int4", scales,
                                    codes if self.dtype == "int4" else codes.view(np.int8))
        return frame

    def encode(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``pack(values)``, what a receiver decodes from it): one pack, one unpack, for a
        sender that sends the frame and feeds the rounding error back."""
        frame = self.pack(values)
        return frame, values if self.exact else unpack(frame, self.dtype, values.size,
                                                       self.block)

    def round(self, values: np.ndarray) -> np.ndarray:
        """What a receiver decodes from ``pack(values)``: float32, a new array (``values``
        itself for float32)."""
        return self.encode(values)[1]


FP32 = ValueFormat()


def _check_out(out: np.ndarray, size: int, dtype, what: str) -> None:
    if not (isinstance(out, np.ndarray) and out.dtype == dtype and out.ndim == 1
            and out.size == size and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"out must be a writeable contiguous {np.dtype(dtype)} array of "
                         f"{size} entries (the {what}), got "
                         f"{getattr(out, 'dtype', type(out).__name__)} "
                         f"{getattr(out, 'shape', '')}")


def _filled(out: np.ndarray | None, result: np.ndarray) -> np.ndarray:
    """``result``, or ``out`` holding it (the paths that compute into a new array)."""
    if out is None:
        return result
    out[:] = result
    return out


def unpack(buf, dtype: str, count: int, block: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of a value frame (a view of it for float32), refused with
    ``ValueFrameError`` when its size or its scales are wrong; written into ``out`` when given
    (a contiguous float32 array of ``count`` entries)."""
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else \
        buf.view(np.uint8)
    expected = frame_bytes(dtype, count, block)
    if data.size != expected:
        raise ValueFrameError(f"{dtype} value frame is {data.size} bytes, expected {expected} "
                              f"for {count} values" + (f" in blocks of {block}"
                                                       if dtype in BLOCK_FORMATS else ""))
    if out is not None:
        _check_out(out, count, np.float32, "values")
    if dtype == "float32":
        return _filled(out, data.view("<f4"))
    fast = not REFERENCE and compiled(count)
    if dtype in ("bfloat16", "float16"):
        codes = data.view("<u2")
        bf16 = dtype == "bfloat16"
        if not fast:
            return _filled(out, quantize.bf16_values(codes) if bf16 else
                           codes.view("<f2").astype(np.float32))
        out = np.empty(count, np.float32) if out is None else out
        (value_kernels.decode_bf16 if bf16 else value_kernels.decode_fp16)(codes, out)
        return out
    blocks = -(-count // block)
    scales, codes = data[:4 * blocks].view("<f4"), data[4 * blocks:]
    if not (np.all(np.isfinite(scales)) and np.all(scales >= 0)):
        raise ValueFrameError(f"{dtype} value frame has a scale that is negative, NaN or "
                              "infinite")
    if not fast:
        unpacked = quantize.unpack_nibbles(codes, count) if dtype == "int4" else codes.view(
            np.int8)
        return _filled(out, quantize.block_values(scales, unpacked, block))
    out = np.empty(count, np.float32) if out is None else out
    value_kernels.decode_blocks(scales, codes if dtype == "int4" else codes.view(np.int8),
                                block, dtype == "int4", count, out)
    return out
