"""Value formats' arithmetic, the numpy reference: float32 values to bf16, fp16, int8, int4 codes.

The numpy reference (written against ``xp``: numpy or CuPy) of the value coding that
``--values`` puts on the wire (docs/protocol.md, "Value formats"), and the test oracle of the
compiled kernels in psparse/ops/values/value_kernels.py (tests/test_values.py holds them to it, bit
for bit). Every function is elementwise or per block, deterministic (round to nearest, ties to
even) and allocates its outputs.

Why block scales are powers of two: a block of int8 (int4) codes shares one float32 scale, and
this encoder picks the smallest power of two 2^e with max|v| <= 127 * 2^e (7 * 2^e). Then a
value's code is exact arithmetic (v / 2^e is a float32 division by a power of two) and the
decoded values q * 2^e encode again to the very same codes and scale: quantizing is
idempotent. That is what lets a worker round its values first (to feed the error back into its
accumulator) and encode them later, and the server round its aggregate in the frame's layout,
with what the receiver decodes equal bit for bit to what the sender subtracted. A receiver
accepts any finite, non-negative float32 scale (a foreign worker may pick max|v| / 127).
"""

from __future__ import annotations

import numpy as np

# the largest code of a block format (codes are in [-QMAX, QMAX]; -8 is a valid int4 nibble
# that this encoder never writes)
QMAX = {"int8": 127, "int4": 7}
# the power of two just above QMAX: QMAX * 2^e >= m <=> QMAX / 2^P >= m's mantissa at e = ex - P
QBITS = {"int8": 7, "int4": 3}
MIN_EXPONENT = -126  # the smallest normal float32 power of two: scales stay normal numbers
# block formats carry magnitudes up to 2^120 (larger ones are clipped to it), so that no code
# times its scale can round past float32's range (2^128)
BLOCK_CLIP = 2.0 ** 120
FP16_MAX = 65504.0  # fp16's largest finite value: larger magnitudes are clipped to it
BF16_MAX_BITS = 0x7F7F  # bf16's largest finite value, as its 16 bits (sign off)


def bf16_codes(values, xp=np):
    """float32 -> the bf16 bit patterns (uint16), rounded to nearest even; a finite value
    that would round past bf16's range is clipped to its largest finite value."""
    bits = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) \
        >> xp.uint32(16)
    magnitude = bits & xp.uint32(0x7FFFFFFF)
    overflow = (magnitude < xp.uint32(0x7F800000)) & \
        ((rounded & xp.uint32(0x7FFF)) == xp.uint32(0x7F80))
    rounded = xp.where(overflow, (rounded & xp.uint32(0x8000)) | xp.uint32(BF16_MAX_BITS),
                       rounded)
    return rounded.astype(xp.uint16)


def bf16_values(codes, xp=np):
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (xp.asarray(codes, dtype=xp.uint16).astype(xp.uint32) << xp.uint32(16)).view(
        xp.float32)


def fp16_codes(values, xp=np):
    """float32 -> float16 (to nearest even), magnitudes past 65504 clipped to it."""
    return xp.clip(xp.asarray(values, dtype=xp.float32), -FP16_MAX, FP16_MAX).astype(xp.float16)


def block_exponents(values, block: int, fmt: str, xp=np):
    """Per block of ``block`` consecutive values: the exponent e of its scale 2^e, the smallest
    with max|v| <= QMAX * 2^e and at least MIN_EXPONENT (so MIN_EXPONENT for a block of
    zeros), as int32."""
    values = xp.clip(xp.asarray(values, dtype=xp.float32), -BLOCK_CLIP, BLOCK_CLIP)
    n = values.size
    blocks = -(-n // block)
    padded = xp.zeros(blocks * block, dtype=xp.float32)
    padded[:n] = xp.abs(values)
    peak = padded.reshape(blocks, block).max(axis=1) if blocks else padded[:0]
    mantissa, exponent = xp.frexp(peak)  # peak = mantissa * 2^exponent, mantissa in [0.5, 1)
    limit = QMAX[fmt] / 2.0 ** QBITS[fmt]  # 127/128, 7/8: the mantissa one more exponent needs
    e = exponent.astype(xp.int32) - QBITS[fmt] + (mantissa > limit).astype(xp.int32)
    e = xp.where(peak == 0, MIN_EXPONENT, e)  # an all-zero block: the smallest scale
    return xp.maximum(e, MIN_EXPONENT).astype(xp.int32)


def block_codes(values, block: int, fmt: str, xp=np):
    """float32 -> (scales float32 [blocks], codes int8 [n]): code = v / scale rounded to
    nearest even, |code| <= QMAX (v clipped to +-BLOCK_CLIP first)."""
    values = xp.clip(xp.asarray(values, dtype=xp.float32), -BLOCK_CLIP, BLOCK_CLIP)
    e = block_exponents(values, block, fmt, xp)
    scales = xp.ldexp(xp.ones(e.size, dtype=xp.float32), e).astype(xp.float32)
    per_entry = xp.repeat(scales, block)[:values.size]
    codes = xp.rint(values.astype(xp.float64) / per_entry.astype(xp.float64))
    return scales, codes.astype(xp.int8)


def block_values(scales, codes, block: int, xp=np):
    """(scales, int8 codes) -> float32 values code * scale (each product rounded once)."""
    per_entry = xp.repeat(xp.asarray(scales, dtype=xp.float32), block)[:codes.size]
    return (codes.astype(xp.float32) * per_entry).astype(xp.float32)


def pack_nibbles(codes, xp=np):
    """int8 codes in [-8, 7] -> bytes of two 4-bit two's-complement codes: entry 2i in the
    low nibble, 2i + 1 in the high one (an odd count leaves the last high nibble 0)."""
    n = codes.size
    padded = xp.zeros(n + (n & 1), dtype=xp.uint8)
    padded[:n] = codes.astype(xp.uint8) & xp.uint8(0x0F)
    return (padded[0::2] | (padded[1::2] << xp.uint8(4))).astype(xp.uint8)


def unpack_nibbles(packed, count: int, xp=np):
    """``pack_nibbles``' bytes -> ``count`` int8 codes in [-8, 7]."""
    packed = xp.asarray(packed, dtype=xp.uint8)
    nibbles = xp.empty(packed.size * 2, dtype=xp.uint8)
    nibbles[0::2] = packed & xp.uint8(0x0F)
    nibbles[1::2] = packed >> xp.uint8(4)
    codes = nibbles[:count].astype(xp.int8)
    return xp.where(codes > 7, codes - 16, codes).astype(xp.int8)
