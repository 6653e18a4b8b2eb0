extern "C" __global__ void psparse_dgc_accumulate(const float* grad, float momentum,
                                                  float* velocity, float* acc, long long n) {
    // DGC momentum correction: velocity = m * velocity + grad; acc += velocity (one pass)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float u = __fadd_rn(__fmul_rn(momentum, velocity[j]), grad[j]);
        velocity[j] = u;
        acc[j] = __fadd_rn(acc[j], u);
    }
}

extern "C" __global__ void psparse_take(const long long* indices, long long n, float* acc,
                                        long long numel, float* velocity, int has_velocity,
                                        float* out) {
    // gather the values sent and zero the accumulator (and DGC velocity, if any) there; an
    // index out of [0, numel) (a policy's fault, refused once the check flags are read) is
    // skipped, so the fault is reported instead of corrupting memory
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        if (at < 0 || at >= numel) { out[j] = 0.0f; continue; }
        out[j] = acc[at];
        acc[at] = 0.0f;
        if (has_velocity) velocity[at] = 0.0f;
    }
}

extern "C" __global__ void psparse_scatter(const long long* indices, const float* values,
                                           long long n, float* out) {
    // out[indices] = values (the aggregate into the zeroed gradient; indices distinct)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[indices[j]] = values[j];
}

extern "C" __global__ void psparse_check_indices(const long long* indices, long long n,
                                                 long long numel, unsigned long long* flags) {
    // a policy's output on the device: flags[0] |= out of [0, numel), flags[1] |= not strictly
    // increasing (read back with the round's copy, so no check waits for the device)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long v = indices[j];
        if (v < 0 || v >= numel) atomicOr(&flags[0], 1ULL);
        if (j > 0 && indices[j - 1] >= v) atomicOr(&flags[1], 1ULL);
    }
}

// ---- a lazily decayed vector (kernels.Decaying) with its scale on the device ----------------
// state = [scale] (double), flag = [renormalise this round]; the decisions are taken here, so
// the host never reads the scale
extern "C" __global__ void psparse_decay(double* scale, double factor, double below, int* flag,
                                         float* top, long long nseg) {
    // scale *= factor; a renormalisation is due once it falls below `below` (then the
    // per-segment maxima, if tracked, are recomputed: cleared here)
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = __dmul_rn(scale[0], factor);
    scale[0] = s;
    flag[0] = s < below;
    if (flag[0]) for (long long i = 0; i < nseg; i++) top[i] = 0.0f;
}

extern "C" __global__ void psparse_limit_check(const float* top, long long nseg, double limit,
                                               const double* scale, int* flag, float* topw) {
    // ema: renormalise when the largest stored priority passes `limit` while scale < 1
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float m = 0.0f;
    for (long long i = 0; i < nseg; i++) m = top[i] > m ? top[i] : m;
    flag[0] = (double)m > limit && scale[0] < 1.0;
    if (flag[0]) for (long long i = 0; i < nseg; i++) topw[i] = 0.0f;
}

extern "C" __global__ void psparse_renormalise(float* stored, long long n, const double* scale,
                                               const int* flag) {
    // when flagged: stored *= scale (as float32), values below float32's smallest normal -> 0
    if (!flag[0]) return;
    float s = (float)scale[0];
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float v = __fmul_rn(stored[j], s);
        stored[j] = fabsf(v) < 1.17549435e-38f ? 0.0f : v;
    }
}

extern "C" __global__ void psparse_segment_max(const float* stored, const long long* bounds,
                                               long long nseg, float* top, const int* flag) {
    // when flagged: top[s] = max of stored over segment s = [bounds[s], bounds[s + 1]), one
    // block per segment (values are >= 0: their bits order as they do)
    __shared__ float best[256];
    if (!flag[0]) return;
    for (long long s = blockIdx.x; s < nseg; s += gridDim.x) {
        float m = 0.0f;
        for (long long j = bounds[s] + threadIdx.x; j < bounds[s + 1]; j += blockDim.x)
            m = stored[j] > m ? stored[j] : m;
        best[threadIdx.x] = m;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w >>= 1) {
            if ((int)threadIdx.x < w && best[threadIdx.x + w] > best[threadIdx.x])
                best[threadIdx.x] = best[threadIdx.x + w];
            __syncthreads();
        }
        if (threadIdx.x == 0) top[s] = best[0];
        __syncthreads();
    }
}

extern "C" __global__ void psparse_renormalised(double* scale, int* flag) {
    // after a flagged renormalisation: scale = 1 and the flag cleared
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (flag[0]) { scale[0] = 1.0; flag[0] = 0; }
}

extern "C" __global__ void psparse_decaying_add(const long long* indices, const float* values,
                                                long long n, double weight, int kind,
                                                const double* scale, float* stored,
                                                const long long* bounds, long long nseg,
                                                float* top, int track_max) {
    // stored[indices] += (weight / scale) * (|values| for kind 0, values for 1, 1 for 2),
    // rounded as numpy does (the float32 factor, then the product, then the sum); with
    // track_max the per-segment maxima grow to the updated values (indices sorted, distinct)
    float w = (float)__ddiv_rn(weight, scale[0]);
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        float add = kind == 2 ? w : __fmul_rn(w, kind == 0 ? fabsf(values[j]) : values[j]);
        float v = __fadd_rn(stored[at], add);
        stored[at] = v;
        if (track_max) {
            long long lo = 0, hi = nseg;  // the segment holding `at`
            while (hi - lo > 1) { long long mid = (lo + hi) / 2; if (bounds[mid] <= at) lo = mid; else hi = mid; }
            atomicMax((unsigned int*)&top[lo], __float_as_uint(v));
        }
    }
}

extern "C" __global__ void psparse_push_add(const long long* indices, const float* values,
                                            long long n, float* sum, unsigned char* touched) {
    // the server's sum, one push at a time in rank order: sum[indices] += values, touched = 1
    // (a push's indices are distinct: no atomics, and the order of additions is the host's)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        long long at = indices[j];
        sum[at] = __fadd_rn(sum[at], values[j]);
        touched[at] = 1;
    }
}

extern "C" __global__ void psparse_dense_add(const float* values, long long n, float* sum,
                                             unsigned char* touched) {
    // a dense push: every entry
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        sum[j] = __fadd_rn(sum[j], values[j]);
        touched[j] = 1;
    }
}

extern "C" __global__ void psparse_divide(float* values, const long long* report, float by) {
    // values[:report[0]] /= by (the mean of the union's sums; report: a radix select's)
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < report[0];
         j += stride)
        values[j] = __fdiv_rn(values[j], by);
}

extern "C" __global__ void psparse_mark(const long long* indices, const long long* segs,
                                        const long long* report, long long nseg,
                                        unsigned char* mask, int value) {
    // mask[i] = value for each segment's selected indices of a radix select (psparse/ops/select/radix.py:
    // segs[s * 10 + 5] is its output base, report[s * 2] how many it selected); every block
    // takes its share of every segment (grid-stride), so a long one is not one block's work
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long s = 0; s < nseg; s++) {
        long long base = segs[s * 10 + 5], count = report[s * 2];
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
             j += stride)
            mask[indices[base + j]] = (unsigned char)value;
    }
}
