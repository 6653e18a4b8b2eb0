"""Value formats compiled for the CPU: bf16, fp16 and int8/int4 block coding, one pass each.

The compiled (numba) form of psparse/ops/values/quantize.py's numpy reference, equal to it bit for
bit (tests/test_values.py). Each kernel reads the values once and writes the frame's bytes where
they go: an int8/int4 value frame is the blocks' float32 scales, then the codes (docs/protocol.md,
"Value formats"), so the encoder takes the frame as one uint8 buffer and writes both parts. fp16 is
bit manipulation too: numpy's float16 casts are exact but take 2-4 ns a value.
"""

from __future__ import annotations

import numpy as np

from ..numba_jit import inlined, kernel

MIN_EXPONENT = -126
BLOCK_CLIP = np.float32(2.0 ** 120)  # quantize.BLOCK_CLIP
CLIP_BITS = np.uint32(0x7B800000)  # BLOCK_CLIP's float32 bits


@inlined
def _peak_bits(bits, base, count):
    """The largest magnitude of ``count`` values from ``base`` (``bits``: their int32 view), as
    its float32 bits (for non-negative floats integer order is float order, and an integer max
    vectorises; kept in int32 lanes, which numba would otherwise widen to int64)."""
    peak = np.int32(0)
    magnitude = np.int32(0x7FFFFFFF)
    for j in range(count):
        x = np.int32(bits[base + j] & magnitude)
        peak = np.int32(x if x > peak else peak)
    return np.uint32(peak)


@inlined
def _encode_int8(values, base, count, inverse, clipped, codes):
    if clipped:  # values past BLOCK_CLIP (never a gradient's): clip each first
        for j in range(count):
            value = min(max(values[base + j], -BLOCK_CLIP), BLOCK_CLIP)
            codes[base + j] = np.int8(np.rint(value * inverse))
    else:
        for j in range(count):
            codes[base + j] = np.int8(np.rint(values[base + j] * inverse))


@inlined
def _encode_int4(values, base, count, inverse, codes):
    for j in range(count):
        i = base + j
        value = min(max(values[i], -BLOCK_CLIP), BLOCK_CLIP)
        code = np.uint8(np.int32(np.rint(value * inverse)) & 0x0F)
        if i & 1:
            codes[i >> 1] |= code << np.uint8(4)
        else:
            codes[i >> 1] = code


@inlined
def _block_scale(peak_bits, qbits, threshold):
    """(the bits of the scale 2^e, of its inverse 2^-e, clipped?) of a block whose largest
    magnitude has these bits: the smallest power of two with peak <= qmax * 2^e, e >=
    MIN_EXPONENT, in integer arithmetic on the bits (frexp and ldexp per block cost three
    times the block's coding). A normal peak 1.f * 2^(E - 127) needs e = E - 126 - qbits, one
    more when its fraction bits f exceed ``threshold``, (2 qmax - 2^qbits) << (23 - qbits),
    where 1.f passes 2 qmax / 2^qbits; a zero or subnormal peak gets MIN_EXPONENT, as any e
    under it does."""
    clipped = peak_bits > CLIP_BITS
    if clipped:
        peak_bits = CLIP_BITS
    biased = np.int64(peak_bits >> np.uint32(23))
    e = np.int64(MIN_EXPONENT)
    if biased != 0:
        e = max(biased - 126 - qbits + (1 if (peak_bits & np.uint32(0x7FFFFF)) > threshold
                                         else 0), np.int64(MIN_EXPONENT))
    return np.uint32((e + 127) << 23), np.uint32((127 - e) << 23), clipped


@kernel
def encode_blocks(values, block, qmax, qbits, nibbles, scales, codes):
    """values float32 [n] -> scales float32 [ceil(n / block)], codes: int8 [n] (``nibbles``
    False) or two 4-bit codes per byte, entry 2i low (uint8 [ceil(n / 2)]).

    Two passes over each block, both in cache: its peak, then its codes (float32 products by
    the power-of-two inverse scale: exact, so equal to the reference's division). The full
    blocks' inner loops run ``block`` times from the block's start, which LLVM vectorises (a
    trip count of min(n, end) - start defeats it: 20x slower); the last block follows."""
    n = values.size
    bits = values.view(np.int32)
    pair = np.empty(2, np.uint32)  # a scale and its inverse, as bits and as floats
    floats = pair.view(np.float32)
    threshold = np.uint32((2 * qmax - (1 << qbits)) << (23 - qbits))  # (_block_scale's)
    full = n // block
    for b in range(full):  # (the same loop as the last block's, with a loop-invariant count)
        base = b * block
        pair[0], pair[1], clipped = _block_scale(_peak_bits(bits, base, block), qbits,
                                                 threshold)
        scales[b] = floats[0]
        if nibbles:
            _encode_int4(values, base, block, floats[1], codes)
        else:
            _encode_int8(values, base, block, floats[1], clipped, codes)
    if full < scales.size:
        base = full * block
        pair[0], pair[1], clipped = _block_scale(_peak_bits(bits, base, n - base), qbits,
                                                 threshold)
        scales[full] = floats[0]
        if nibbles:
            _encode_int4(values, base, n - base, floats[1], codes)
        else:
            _encode_int8(values, base, n - base, floats[1], clipped, codes)


@kernel
def decode_blocks(scales, codes, block, nibbles, count, out):
    """``encode_blocks``' scales and codes -> ``count`` float32 values, code * scale, block by
    block (one scale per inner loop; full blocks vectorised as in ``encode_blocks``)."""
    full = count // block
    for b in range(full):  # (the same loop as the last block's, with a loop-invariant count)
        _decode_block(scales[b], codes, b * block, block, nibbles, out)
    if full < scales.size:
        _decode_block(scales[full], codes, full * block, count - full * block, nibbles, out)


@inlined
def _decode_block(scale, codes, base, length, nibbles, out):
    if nibbles:
        for j in range(length):
            i = base + j
            byte = np.int32(codes[i >> 1])
            code = ((byte >> 4) if i & 1 else byte) & 0x0F
            out[i] = np.float32(code - ((code & 8) << 1)) * scale
    else:
        for j in range(length):
            out[base + j] = np.float32(codes[base + j]) * scale


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


FP16_MAX = np.float32(65504.0)  # quantize.FP16_MAX


@kernel
def encode_fp16(values, out):
    """float32 -> fp16 bit patterns (uint16), nearest even, magnitudes past 65504 clipped to
    it (quantize.fp16_codes: numpy's clip then float16 cast), NaN kept a NaN."""
    bits = values.view(np.uint32)
    for i in range(bits.size):
        u = bits[i]
        sign = (u >> np.uint32(16)) & np.uint32(0x8000)
        a = u & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN
            out[i] = np.uint16(sign | np.uint32(0x7E00))
        elif a >= np.uint32(0x477FE000):  # 65504 and past it (inf too): the largest fp16
            out[i] = np.uint16(sign | np.uint32(0x7BFF))
        elif a >= np.uint32(0x38800000):  # a normal fp16: rebias, round at bit 13
            out[i] = np.uint16(sign | (((a + np.uint32(0xFFF) + ((a >> np.uint32(13)) &
                                                                 np.uint32(1)))
                                        >> np.uint32(13)) - np.uint32(112 << 10)))
        else:  # subnormal (or zero): |v| / 2^-24 to the nearest even integer (exact product)
            magnitude = values[i] if sign == 0 else -values[i]
            out[i] = np.uint16(sign | np.uint32(np.rint(magnitude * np.float32(16777216.0))))


@kernel
def decode_fp16(codes, out):
    """fp16 bit patterns -> float32 (exact)."""
    bits = out.view(np.uint32)
    for i in range(codes.size):
        h = np.uint32(codes[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        e = (h >> np.uint32(10)) & np.uint32(0x1F)
        m = h & np.uint32(0x3FF)
        if e == 0:  # zero or subnormal: m * 2^-24
            out[i] = np.float32(m) * np.float32(5.9604644775390625e-08)
            bits[i] |= sign
        elif e == 31:  # inf or NaN
            bits[i] = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
        else:
            bits[i] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))


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
        for encode, decode in ((encode_bf16, decode_bf16), (encode_fp16, decode_fp16)):
            encode(vals, out16)
            for c in (out16, np.frombuffer(out16.tobytes(), np.uint16)):
                decode(c, np.empty(3, np.float32))
