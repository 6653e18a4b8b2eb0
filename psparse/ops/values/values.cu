// Value formats on the device (--values; docs/protocol.md, "Value formats"), and a variable
// selection's compaction (psparse_compact, at the end): a push's values rounded to the run's
// format where the selection left them, the frames' bytes written for the
// round's one copy back, and what rounding took from each value fed back into the worker's
// memory, all before the copy. Bit for bit the numpy reference (psparse/ops/values/quantize.py) and
// the numba kernels (psparse/ops/values/value_kernels.py): power-of-two block scales, integer peaks,
// products by exact inverse scales, round to nearest even, the _rn intrinsics throughout.
//
// The values to send are the selection's "compact sequence": source segment s (a slice's run
// of the engine's output) holds positions [seg_first[s], seg_first[s] + count_s), stored from
// starts[s] in the device arrays. A push goes as F frames (one per key-range shard it touches;
// F = 1 on one server), frame f holding the compact positions from the first whose index is
// at least edges[f - 1]. psparse_value_layout writes the LAYOUT table that the others read:
//   layout[0]            the compact count
//   layout[1 + 4f + 0]   frame f's first compact position
//   layout[1 + 4f + 1]   its count
//   layout[1 + 4f + 2]   its first block (int8/int4: its scales start there)
//   layout[1 + 4f + 3]   its first code byte (int4: two codes a byte, per frame)
// The host slices the copied-back scales and codes with the same table, recomputed from the
// copied-back indices (psparse/worker/device_values.py), so nothing else comes back.
//
// format: 1 bf16, 2 fp16, 3 int8, 4 int4. memory: the array the error goes into (the
// accumulator, or ScaleCom's filtered memory with scaled = 1: beta times the error).

#define PV_BF16 1
#define PV_FP16 2
#define PV_INT8 3
#define PV_INT4 4
#define PV_W 4
#define PV_MIN_EXPONENT (-126)
#define PV_CLIP_BITS 0x7B800000u  // 2^120, BLOCK_CLIP: block formats clip magnitudes to it
#define PV_FP16_MAX 65504.0f

__device__ __forceinline__ long long pv_index(const int* idx32, const long long* idx64, int wide,
                                             long long q) {
    return wide ? idx64[q] : (long long)idx32[q];
}

// the position in the device arrays of compact position p: its source segment's start plus
// its offset there (seg_first is increasing: the last segment that starts at or before p)
__device__ __forceinline__ long long pv_stored(const long long* seg_first,
                                              const long long* starts, int nseg, long long p) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (seg_first[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return starts[lo] + (p - seg_first[lo]);
}

extern "C" __global__ void psparse_value_layout(const long long* report, int report_width,
                                                int variable,
                                                const long long* ks, const long long* starts,
                                                int nseg, const int* idx32,
                                                const long long* idx64, int wide,
                                                const long long* edges, int nframes,
                                                long long block, int format,
                                                long long* seg_first, long long* layout) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;  // a few segments and frames: one thread
    long long total = 0;
    for (int s = 0; s < nseg; s++) {
        seg_first[s] = total;
        total += variable ? report[(long long)s * report_width] : ks[s];  // count first
    }
    layout[0] = total;
    long long first = 0, first_block = 0, first_byte = 0;
    for (int f = 0; f < nframes; f++) {
        long long end = total;  // the first compact position of the next frame
        if (f + 1 < nframes) {
            long long lo = first, hi = total, edge = edges[f];
            while (lo < hi) {  // the first position whose index is >= edge (indices sorted)
                long long mid = lo + (hi - lo) / 2;
                if (pv_index(idx32, idx64, wide, pv_stored(seg_first, starts, nseg, mid)) < edge)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            end = lo;
        }
        long long count = end - first;
        long long* row = layout + 1 + (long long)f * PV_W;
        row[0] = first; row[1] = count; row[2] = first_block; row[3] = first_byte;
        first_block += (count + block - 1) / block;
        first_byte += format == PV_INT4 ? (count + 1) / 2 : count;
        first = end;
    }
}

// what rounding took from a value, into the memory at its index (a policy's index out of
// range writes nothing: the check kernel's flag refuses the round after the copy back)
__device__ __forceinline__ void pv_feed_back(float* memory, long long numel, long long index,
                                             float value, float decoded, float beta,
                                             int scaled) {
    if (index < 0 || index >= numel) return;
    float error = __fsub_rn(value, decoded);
    memory[index] = __fadd_rn(memory[index], scaled ? __fmul_rn(beta, error) : error);
}

// int8 and int4: one CUDA block per value block. Its peak magnitude (clipped to 2^120) as the
// max of the bits, its scale 2^e the smallest power of two with peak <= qmax * 2^e (e at least
// -126), then each value's code rint(v / 2^e) (int4: to the scratch codes, packed after).
extern "C" __global__ void psparse_value_blocks(const float* values, const int* idx32,
                                                const long long* idx64, int wide,
                                                const long long* seg_first,
                                                const long long* starts, int nseg,
                                                const long long* layout, int nframes,
                                                long long block, int qmax, int qbits,
                                                float* memory, long long numel, float beta,
                                                int scaled, float* scales,
                                                signed char* codes) {
    __shared__ unsigned peak_of[1024];
    __shared__ float scale_of[2];
    long long g = blockIdx.x;
    int f = 0;
    while (f < nframes && g >= layout[1 + f * PV_W + 2] +
           (layout[1 + f * PV_W + 1] + block - 1) / block) f++;
    if (f == nframes) return;  // past the last block (the grid is an upper bound)
    const long long* row = layout + 1 + (long long)f * PV_W;
    long long begin = row[0] + (g - row[2]) * block;
    long long end = begin + block < row[0] + row[1] ? begin + block : row[0] + row[1];
    unsigned peak = 0;
    for (long long p = begin + threadIdx.x; p < end; p += blockDim.x) {
        unsigned bits = __float_as_uint(values[pv_stored(seg_first, starts, nseg, p)])
                        & 0x7FFFFFFFu;
        peak = bits > peak ? bits : peak;
    }
    peak_of[threadIdx.x] = peak;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half && peak_of[threadIdx.x + half] > peak_of[threadIdx.x])
            peak_of[threadIdx.x] = peak_of[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        unsigned bits = peak_of[0] > PV_CLIP_BITS ? PV_CLIP_BITS : peak_of[0];
        int e = PV_MIN_EXPONENT;
        if (bits) {
            int exponent;
            float mantissa = frexpf(__uint_as_float(bits), &exponent);
            e = exponent - qbits + ((double)mantissa > (double)qmax / (double)(1 << qbits));
            e = e > PV_MIN_EXPONENT ? e : PV_MIN_EXPONENT;
        }
        scale_of[0] = ldexpf(1.0f, e);
        scale_of[1] = ldexpf(1.0f, -e);
        scales[g] = scale_of[0];
    }
    __syncthreads();
    float scale = scale_of[0], inverse = scale_of[1];
    float clip = __uint_as_float(PV_CLIP_BITS);
    for (long long p = begin + threadIdx.x; p < end; p += blockDim.x) {
        long long q = pv_stored(seg_first, starts, nseg, p);
        float value = values[q];
        float clipped = value > clip ? clip : (value < -clip ? -clip : value);
        int code = __float2int_rn(__fmul_rn(clipped, inverse));
        codes[p] = (signed char)code;
        pv_feed_back(memory, numel, pv_index(idx32, idx64, wide, q), value,
                     __fmul_rn((float)code, scale), beta, scaled);
    }
}

// int4: the scratch codes of each frame two to a byte, the even position in the low nibble
extern "C" __global__ void psparse_value_nibbles(const signed char* codes,
                                                 const long long* layout, int nframes,
                                                 unsigned char* packed) {
    long long total = layout[0];
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < total;
         p += (long long)gridDim.x * blockDim.x) {
        int f = 0;
        while (f + 1 < nframes && p >= layout[1 + (f + 1) * PV_W]) f++;
        const long long* row = layout + 1 + (long long)f * PV_W;
        long long local = p - row[0];
        if (local & 1) continue;  // the pair's even entry writes its byte
        unsigned lo = (unsigned)codes[p] & 0x0Fu;
        unsigned hi = local + 1 < row[1] ? ((unsigned)codes[p + 1] & 0x0Fu) : 0u;
        packed[row[3] + local / 2] = (unsigned char)(lo | (hi << 4));
    }
}

// float32 -> bf16 bits, nearest even, a finite value kept finite (the largest bf16 instead)
__device__ __forceinline__ unsigned pv_bf16(float value) {
    unsigned u = __float_as_uint(value);
    unsigned rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    if ((u & 0x7FFFFFFFu) < 0x7F800000u && (rounded & 0x7FFFu) == 0x7F80u)
        rounded = (rounded & 0x8000u) | 0x7F7Fu;
    return rounded & 0xFFFFu;
}

// float32 -> fp16 bits, nearest even, magnitudes past 65504 clipped to it (numpy's
// clip(...).astype(float16))
__device__ __forceinline__ unsigned pv_fp16(float value) {
    float clipped = value > PV_FP16_MAX ? PV_FP16_MAX :
                    (value < -PV_FP16_MAX ? -PV_FP16_MAX : value);
    unsigned u = __float_as_uint(clipped);
    unsigned sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN (never a pushed value)
    if (a >= 0x38800000u)  // a normal half: rebias the exponent, round at bit 13
        return sign | (((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10));
    // a subnormal half (or zero): |v| / 2^-24 to the nearest even integer; 1024 is the
    // smallest normal's bits, as it should be
    return sign | (unsigned)__float2int_rn(__fmul_rn(__uint_as_float(a), 16777216.0f));
}

__device__ __forceinline__ float pv_fp16_value(unsigned h) {
    unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        float magnitude = __fmul_rn((float)m, 5.9604644775390625e-08f);  // m * 2^-24, exact
        return __uint_as_float(__float_as_uint(magnitude) | sign);
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// bf16 and fp16: each value on its own, codes at their compact positions
extern "C" __global__ void psparse_value_halves(const float* values, const int* idx32,
                                                const long long* idx64, int wide,
                                                const long long* seg_first,
                                                const long long* starts, int nseg,
                                                const long long* layout, int format,
                                                float* memory, long long numel, float beta,
                                                int scaled, unsigned short* codes) {
    long long total = layout[0];
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < total;
         p += (long long)gridDim.x * blockDim.x) {
        long long q = pv_stored(seg_first, starts, nseg, p);
        float value = values[q];
        unsigned code = format == PV_BF16 ? pv_bf16(value) : pv_fp16(value);
        float decoded = format == PV_BF16 ? __uint_as_float(code << 16) : pv_fp16_value(code);
        codes[p] = (unsigned short)code;
        pv_feed_back(memory, numel, pv_index(idx32, idx64, wide, q), value, decoded, beta,
                     scaled);
    }
}

// A variable selection (a threshold's: its count known only from the report) made contiguous,
// so that the copy back can stop near its count instead of moving the whole capacity
// (psparse/worker/device_copy.py): compact position p of the layout (psparse_value_layout with
// one frame) gets the index and value stored for it.
extern "C" __global__ void psparse_compact(const int* idx32, const long long* idx64, int wide,
                                           const float* values, const long long* seg_first,
                                           const long long* starts, int nseg,
                                           const long long* layout, int* out32,
                                           long long* out64, float* out_values) {
    long long total = layout[0];
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < total;
         p += (long long)gridDim.x * blockDim.x) {
        long long q = pv_stored(seg_first, starts, nseg, p);
        if (wide) out64[p] = idx64[q]; else out32[p] = idx32[q];
        out_values[p] = values[q];
    }
}
