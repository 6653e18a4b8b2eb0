"""Value formats compiled for the CPU: bf16 and int8/int4 block coding, one pass each.

The compiled (numba) form of psparse/cpu/quantize.py's numpy reference, equal to it bit for bit
(tests/test_values.py). Each kernel reads the values once and writes the frame's bytes where
they go: an int8/int4 value frame is the blocks' float32 scales, then the codes (docs/protocol.md,
"Value formats"), so the encoder takes the frame as one uint8 buffer and writes both parts.
fp16 needs no kernel: numpy's float16 cast is C already.
"""

from __future__ import annotations

import math

import numpy as np

from .numba_jit import kernel

MIN_EXPONENT = -126
BLOCK_CLIP = np.float32(2.0 ** 120)  # quantize.BLOCK_CLIP


@kernel
def encode_blocks(values, block, qmax, qbits, nibbles, scales, codes):
    """values float32 [n] -> scales float32 [ceil(n / block)], codes: int8 [n] (``nibbles``
    False) or two 4-bit codes per byte, entry 2i low (uint8 [ceil(n / 2)]). Two passes over
    each block, both in cache: its peak, then its codes (float32 products by the power-of-two
    inverse scale: exact, so equal to the reference's division)."""
    n = values.size
    limit = qmax / 2.0 ** qbits
    for b in range(scales.size):
        lo = b * block
        hi = min(n, lo + block)
        peak = np.float32(0.0)
        for i in range(lo, hi):
            peak = max(peak, abs(values[i]))
        peak = min(peak, BLOCK_CLIP)
        mantissa, exponent = math.frexp(peak)
        e = exponent - qbits + (1 if mantissa > limit else 0)
        e = max(e, MIN_EXPONENT) if peak > 0 else MIN_EXPONENT  # (frexp(0) is (0, 0))
        scales[b] = np.float32(math.ldexp(1.0, e))
        inverse = np.float32(math.ldexp(1.0, -e))
        if nibbles:  # lo is even whenever block is (one byte per pair); else entry by entry
            for i in range(lo, hi):
                value = min(max(values[i], -BLOCK_CLIP), BLOCK_CLIP)
                code = np.uint8(np.int32(np.rint(value * inverse)) & 0x0F)
                if i & 1:
                    codes[i >> 1] |= code << np.uint8(4)
                else:
                    codes[i >> 1] = code
        else:
            for i in range(lo, hi):
                value = min(max(values[i], -BLOCK_CLIP), BLOCK_CLIP)
                codes[i] = np.int8(np.rint(value * inverse))


@kernel
def decode_blocks(scales, codes, block, nibbles, count, out):
    """``encode_blocks``' scales and codes -> ``count`` float32 values, code * scale, block by
    block (one scale per inner loop)."""
    for b in range(scales.size):
        lo = b * block
        hi = min(count, lo + block)
        scale = scales[b]
        if nibbles:
            for i in range(lo, hi):
                byte = np.int32(codes[i >> 1])
                code = ((byte >> 4) if i & 1 else byte) & 0x0F
                out[i] = np.float32(code - ((code & 8) << 1)) * scale
        else:
            for i in range(lo, hi):
                out[i] = np.float32(codes[i]) * scale


@kernel
def encode_bf16(values, out):
    """float32 -> bf16 bit patterns (uint16), nearest even, finite values kept finite."""
    bits = values.view(np.uint32)
    for i in range(bits.size):
        u = bits[i]
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        if (u & np.uint32(0x7FFFFFFF)) < np.uint32(0x7F800000) and \
                (rounded & np.uint32(0x7FFF)) == np.uint32(0x7F80):
            rounded = (rounded & np.uint32(0x8000)) | np.uint32(0x7F7F)
        out[i] = np.uint16(rounded)


@kernel
def decode_bf16(codes, out):
    """bf16 bit patterns -> float32."""
    bits = out.view(np.uint32)
    for i in range(codes.size):
        bits[i] = np.uint32(codes[i]) << np.uint32(16)


def warm_up() -> None:
    """Compile or load every kernel for the argument types the package passes (values owned or
    read-only: a received frame)."""
    values = np.ones(3, np.float32)
    for vals in (values, np.frombuffer(values.tobytes(), np.float32)):
        scales = np.empty(1, np.float32)
        for nibbles, codes in ((False, np.empty(3, np.int8)), (True, np.empty(2, np.uint8))):
            encode_blocks(vals, 128, 127, 7, nibbles, scales, codes)
            for s, c in ((scales, codes), (np.frombuffer(scales.tobytes(), np.float32),
                                           np.frombuffer(codes.tobytes(), codes.dtype))):
                decode_blocks(s, c, 128, nibbles, 3, np.empty(3, np.float32))
        out16 = np.empty(3, np.uint16)
        encode_bf16(vals, out16)
        for c in (out16, np.frombuffer(out16.tobytes(), np.uint16)):
            decode_bf16(c, np.empty(3, np.float32))
