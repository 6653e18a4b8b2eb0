// The device selection engine's CUDA C (psparse/gpu/radix.py drives it; psparse/gpu/sources.py
// loads it). Compiled by CuPy/NVRTC on a GPU, by `make check-kernels` without one, and run on
// the CPU by psparse/gpu/kernel_emu.py in the tests.
#define RS_THREADS 256
#define RS_ITEMS 16
#define RS_TILE (RS_THREADS * RS_ITEMS)
#define RS_WARPS (RS_THREADS / 32)
#define RS_MAXBINS 4096

// segment table (host constants), SG_W int64 per segment
#define SG_LO 0
#define SG_HI 1
#define SG_K 2
#define SG_CBASE 3
#define SG_CCAP 4
#define SG_OBASE 5
#define SG_TILE0 6
#define SG_NTILES 7
#define SG_CHUNK0 8
#define SG_NCHUNKS 9
#define SG_W 10
// state (device-written), ST_W int64 per segment
#define ST_PREFIX 0
#define ST_NEED 1
#define ST_MODE 2
#define ST_CAND 3
#define ST_BAD 4
#define ST_W 8
#define MODE_BUF 0
#define MODE_FULL 1
#define MODE_ALL 2
#define MODE_NONE 3
// report (copied back), RP_W int64 per segment
#define RP_OUT 0
#define RP_BAD 1
#define RP_W 2

#define KEY_ABS 0
#define KEY_EMA 1
#define KEY_PENALTY 2
#define KEY_PRIORITY 3
#define KEY_CORE 4
#define KEY_FREQ 5
#define KEY_THRESHOLD 6
#define KEY_MASK 7

#define ACC_NONE 0
#define ACC_RESIDUAL 1
#define ACC_DGC 2
#define ACC_FILTERED 3

typedef unsigned long long u64;

struct KeySrc {
    int mode; const float* x; const float* aux; const unsigned char* mask;
    const long long* gather; int use_gather; float p0; const float* pdev;
};

// The selection key of position p (of segment seg): non-negative float32 magnitudes order as
// their bit patterns, so a key is those bits (KEY_FREQ: 64 bits, priority then magnitude).
// A non-finite score sets *bad and gets key 0 (the run is refused once the report is read).
__device__ __forceinline__ u64 rs_key(const KeySrc& s, long long p, long long seg, int* bad) {
    long long g = s.use_gather ? s.gather[p] : p;
    float m;
    switch (s.mode) {
    case KEY_EMA: {
        float a = s.x[g], top = s.pdev[seg];
        if (top > 0.0f && s.p0 != 0.0f) {  // |acc| * (stored + max(stored) / lam)
            float floor = __fdiv_rn(top, s.p0);
            m = fabsf(__fmul_rn(__fadd_rn(s.aux[g], floor), a));
        } else {
            m = fabsf(a);
        }
        break;
    }
    case KEY_PENALTY:
        m = fabsf(s.x[g]);
        if (!s.mask[g]) m = __fmul_rn(m, s.p0);
        break;
    case KEY_PRIORITY:
        m = s.aux[g];
        if (s.p0 != 0.0f) m = fabsf(m);  // p0: a signed priority, ranked by magnitude
        break;
    case KEY_CORE:
        m = fabsf(s.x[g]);
        if (isfinite(m) && s.mask[g]) return 0x7F7FFFFFull;  // the core: float32's maximum
        break;
    case KEY_THRESHOLD:
        m = fabsf(s.x[g]);
        if (isfinite(m) && !(m >= s.p0)) return 0ull;  // below the threshold: never selected
        break;
    case KEY_MASK:  // a byte mask: 1 where set (the server's touched entries)
        return s.mask[g] ? 1ull : 0ull;
    case KEY_FREQ: {
        float prio = s.aux[g];
        m = fabsf(s.x[g]);
        if (!isfinite(m) || !isfinite(prio) || prio < 0.0f) { *bad = 1; return 0ull; }
        if (prio == 0.0f) prio = 0.0f;  // -0.0 ranks as 0
        return ((u64)__float_as_uint(prio) << 32) | (u64)__float_as_uint(m);
    }
    default:
        m = fabsf(s.x[g]);
    }
    if (!isfinite(m) || m < 0.0f) { *bad = 1; return 0ull; }  // a negative score: no key
    return m == 0.0f ? 0ull : (u64)__float_as_uint(m);  // -0.0 is 0
}

#define RS_KEY_SRC KeySrc src = {key_mode, x, aux, mask, gather, use_gather, p0, pdev}

// exclusive prefix over the block's threads (in thread order) of v, and the block's total
__device__ __forceinline__ u64 rs_block_scan(u64 v, u64* sh_w, u64* total) {
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 x = v;
    for (int d = 1; d < 32; d <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, x, d);
        if ((int)lane >= d) x += y;
    }
    if (lane == 31) sh_w[warp] = x;
    __syncthreads();
    u64 off = 0, tot = 0;
    for (unsigned w = 0; w < RS_WARPS; w++) {
        u64 c = sh_w[w];
        if (w < warp) off += c;
        tot += c;
    }
    __syncthreads();
    *total = tot;
    return off + x - v;
}

// the ranks of two flags among the block's threads (thread order), and their totals
__device__ __forceinline__ void rs_rank2(int fa, int fb, unsigned* sh, unsigned* ra,
                                         unsigned* rb, unsigned* ta, unsigned* tb) {
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned ba = __ballot_sync(0xffffffffu, fa), bb = __ballot_sync(0xffffffffu, fb);
    if (lane == 0) { sh[warp] = __popc(ba); sh[RS_WARPS + warp] = __popc(bb); }
    __syncthreads();
    unsigned oa = 0, ob = 0, sa = 0, sb = 0;
    for (unsigned w = 0; w < RS_WARPS; w++) {
        unsigned ca = sh[w], cb = sh[RS_WARPS + w];
        if (w < warp) { oa += ca; ob += cb; }
        sa += ca; sb += cb;
    }
    __syncthreads();
    unsigned below = (1u << lane) - 1u;
    *ra = oa + __popc(ba & below); *rb = ob + __popc(bb & below);
    *ta = sa; *tb = sb;
}

__device__ __forceinline__ void rs_accumulate(int mode, long long g, float* acc,
                                              const float* grad, float* velocity,
                                              const float* filtered, float momentum) {
    if (mode == ACC_RESIDUAL) {
        acc[g] = __fadd_rn(acc[g], grad[g]);
    } else if (mode == ACC_DGC) {  // velocity = m * velocity + grad; acc += velocity
        float u = __fadd_rn(__fmul_rn(momentum, velocity[g]), grad[g]);
        velocity[g] = u;
        acc[g] = __fadd_rn(acc[g], u);
    } else if (mode == ACC_FILTERED) {  // scalecom: acc = filtered memory + grad
        acc[g] = __fadd_rn(filtered[g], grad[g]);
    }
}

// the block's shared histogram into the segment's row of the global one, then cleared
__device__ void rs_flush(unsigned* sh, int* sh_bad, int nb, long long seg, unsigned int* hist,
                         long long* state) {
    __syncthreads();
    for (int i = threadIdx.x; i < nb; i += RS_THREADS) {
        unsigned c = sh[i];
        if (c) { atomicAdd(&hist[seg * RS_MAXBINS + i], c); sh[i] = 0; }
    }
    if (threadIdx.x == 0 && *sh_bad) {
        atomicAdd((u64*)&state[seg * ST_W + ST_BAD], (u64)*sh_bad);
        *sh_bad = 0;
    }
    __syncthreads();
}

// Level 0 over every tile: the histogram of the top digit of each segment's keys, the count of
// non-finite scores, and (accumulate != ACC_NONE) error feedback folded in first, in the same
// pass. Blocks take contiguous runs of tiles.
extern "C" __global__ void psparse_rs_hist0(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, int accumulate, float* acc,
                                            const float* grad, float* velocity,
                                            const float* filtered, float momentum,
                                            const long long* tiles, long long ntiles,
                                            const long long* segs, long long* state,
                                            unsigned int* hist, int shift, int bits) {
    RS_KEY_SRC;
    __shared__ unsigned sh[RS_MAXBINS];
    __shared__ int sh_bad;
    int nb = 1 << bits;
    for (int i = threadIdx.x; i < nb; i += RS_THREADS) sh[i] = 0;
    if (threadIdx.x == 0) sh_bad = 0;
    __syncthreads();
    long long t0 = (long long)blockIdx.x * ntiles / gridDim.x;
    long long t1 = ((long long)blockIdx.x + 1) * ntiles / gridDim.x;
    long long current = -1;
    for (long long t = t0; t < t1; t++) {
        long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
        if (seg != current) {
            if (current >= 0) rs_flush(sh, &sh_bad, nb, current, hist, state);
            current = seg;
        }
        int selecting = segs[seg * SG_W + SG_K] > 0;
        for (long long p = lo + threadIdx.x; p < hi; p += RS_THREADS) {
            if (accumulate != ACC_NONE)
                rs_accumulate(accumulate, use_gather ? gather[p] : p, acc, grad, velocity,
                              filtered, momentum);
            int bad = 0;
            u64 key = rs_key(src, p, seg, &bad);
            if (bad && selecting) atomicAdd(&sh_bad, 1);  // as the host: selected slices only
            atomicAdd(&sh[(unsigned)(key >> shift) & (unsigned)(nb - 1)], 1u);
        }
    }
    if (current >= 0) rs_flush(sh, &sh_bad, nb, current, hist, state);
}

// One block per segment: in the histogram of a level, the digit where the count from the top
// reaches what is still needed; the prefix grows by it. Level 0 also decides the mode: the
// candidates (every key in or above that digit) fit the segment's buffer (MODE_BUF) or not
// (MODE_FULL: the next levels read the whole segment). The histogram row is left zeroed.
extern "C" __global__ void psparse_rs_scan(const long long* segs, long long* state,
                                           unsigned int* hist, int level, int shift, int bits,
                                           int last, int exclude_zero) {
    __shared__ u64 sh_w[RS_WARPS];
    __shared__ long long found[2];
    long long s = blockIdx.x;
    const long long* sg = segs + s * SG_W;
    long long* st = state + s * ST_W;
    unsigned* h = hist + s * RS_MAXBINS;
    int nb = 1 << bits;
    long long n = sg[SG_HI] - sg[SG_LO], k = sg[SG_K];
    long long mode = level == 0 ? (k <= 0 ? MODE_NONE : (k >= n ? MODE_ALL : MODE_BUF))
                                : st[ST_MODE];
    if (mode == MODE_NONE || mode == MODE_ALL) {
        for (int i = threadIdx.x; i < nb; i += RS_THREADS) h[i] = 0;
        if (threadIdx.x == 0 && level == 0) {
            st[ST_MODE] = mode; st[ST_PREFIX] = 0; st[ST_NEED] = 0; st[ST_CAND] = 0;
        }
        return;
    }
    long long need = level == 0 ? k : st[ST_NEED];
    if (threadIdx.x == 0) { found[0] = 0; found[1] = 0; }
    int per = (nb + RS_THREADS - 1) / RS_THREADS;
    u64 mine = 0;  // thread t holds the bins nb-1-t*per ... downwards
    for (int j = 0; j < per; j++) {
        int i = threadIdx.x * per + j;
        if (i < nb) mine += h[nb - 1 - i];
    }
    u64 total;
    u64 before = rs_block_scan(mine, sh_w, &total);
    if (before < (u64)need && (u64)need <= before + mine) {  // exactly one thread
        u64 run = before;
        for (int j = 0; j < per; j++) {
            int i = threadIdx.x * per + j;
            if (i >= nb) break;
            u64 c = h[nb - 1 - i];
            if (run + c >= (u64)need) { found[0] = nb - 1 - i; found[1] = (long long)run; break; }
            run += c;
        }
    }
    __syncthreads();
    long long digit = found[0], above = found[1];
    long long in_digit = h[digit];
    __syncthreads();
    for (int i = threadIdx.x; i < nb; i += RS_THREADS) h[i] = 0;
    if (threadIdx.x == 0) {
        long long prefix = (level == 0 ? 0 : st[ST_PREFIX]) | (digit << shift);
        need -= above;
        if (level == 0) {
            st[ST_CAND] = above + in_digit;
            st[ST_MODE] = above + in_digit <= sg[SG_CCAP] ? MODE_BUF : MODE_FULL;
        }
        if (last && exclude_zero && prefix == 0) need = 0;  // zero keys are never selected
        st[ST_PREFIX] = prefix;
        st[ST_NEED] = need;
    }
}

// MODE_BUF segments, one block per tile: how many of the tile's keys are candidates.
extern "C" __global__ void psparse_rs_count_cand(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles,
                                                 const long long* state, long long* counts) {
    RS_KEY_SRC;
    __shared__ u64 sh_w[RS_WARPS];
    long long t = blockIdx.x;
    long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
    const long long* st = state + seg * ST_W;
    if (st[ST_MODE] != MODE_BUF) {
        if (threadIdx.x == 0) counts[t] = 0;
        return;
    }
    u64 floor = (u64)st[ST_PREFIX], mine = 0;
    for (long long p = lo + threadIdx.x; p < hi; p += RS_THREADS) {
        int bad = 0;
        mine += rs_key(src, p, seg, &bad) >= floor;
    }
    u64 total;
    rs_block_scan(mine, sh_w, &total);
    if (threadIdx.x == 0) counts[t] = (long long)total;
}

// One block: exclusive prefix sums of two count arrays over n units (offsets[n] = the total).
// finish != 0: also each segment's output count, and the report (out, non-finite) it keeps;
// the non-finite count is cleared for the next call.
extern "C" __global__ void psparse_rs_scan_units(const long long* count_a,
                                                 const long long* count_b, long long n,
                                                 long long* off_a, long long* off_b,
                                                 int finish, const long long* segs,
                                                 long long nseg, long long ntiles,
                                                 long long* state, long long* report) {
    __shared__ u64 sh_w[RS_WARPS];
    __shared__ u64 carry[2];
    if (threadIdx.x == 0) { carry[0] = 0; carry[1] = 0; }
    __syncthreads();
    for (long long base = 0; base < n; base += RS_THREADS) {
        long long u = base + threadIdx.x;
        u64 a = u < n ? (u64)count_a[u] : 0, b = u < n ? (u64)count_b[u] : 0, ta, tb;
        u64 pa = rs_block_scan(a, sh_w, &ta);
        u64 pb = rs_block_scan(b, sh_w, &tb);
        if (u < n) { off_a[u] = (long long)(carry[0] + pa); off_b[u] = (long long)(carry[1] + pb); }
        __syncthreads();
        if (threadIdx.x == 0) { carry[0] += ta; carry[1] += tb; }
        __syncthreads();
    }
    if (threadIdx.x == 0) { off_a[n] = (long long)carry[0]; off_b[n] = (long long)carry[1]; }
    __syncthreads();
    if (!finish) return;
    for (long long s = threadIdx.x; s < nseg; s += RS_THREADS) {
        const long long* sg = segs + s * SG_W;
        long long* st = state + s * ST_W;
        long long mode = st[ST_MODE], out = 0;
        if (mode != MODE_NONE) {
            long long first = mode == MODE_BUF ? ntiles + sg[SG_CHUNK0] : sg[SG_TILE0];
            long long count = mode == MODE_BUF ? sg[SG_NCHUNKS] : sg[SG_NTILES];
            long long strict = off_a[first + count] - off_a[first];
            long long ties = off_b[first + count] - off_b[first];
            out = strict + (ties < st[ST_NEED] ? ties : st[ST_NEED]);
        }
        report[s * RP_W + RP_OUT] = out;
        report[s * RP_W + RP_BAD] = st[ST_BAD];
        st[ST_BAD] = 0;
    }
}

// MODE_BUF segments, one block per tile: the tile's candidates, in position order, into the
// segment's buffer (their keys and positions), at the offsets the unit scan gave the tiles.
extern "C" __global__ void psparse_rs_write_cand(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles,
                                                 const long long* segs, const long long* state,
                                                 const long long* offsets, unsigned long long* cand_key,
                                                 long long* cand_pos) {
    RS_KEY_SRC;
    __shared__ unsigned sh[2 * RS_WARPS];
    long long t = blockIdx.x;
    long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
    const long long* sg = segs + seg * SG_W;
    const long long* st = state + seg * ST_W;
    if (st[ST_MODE] != MODE_BUF) return;
    u64 floor = (u64)st[ST_PREFIX];
    long long at = sg[SG_CBASE] + offsets[t] - offsets[sg[SG_TILE0]];
    for (long long r = lo; r < hi; r += RS_THREADS) {
        long long p = r + threadIdx.x;
        int bad = 0;
        u64 key = p < hi ? rs_key(src, p, seg, &bad) : 0;
        int hit = p < hi && key >= floor;
        unsigned rank, unused, total, unused_total;
        rs_rank2(hit, 0, sh, &rank, &unused, &total, &unused_total);
        if (hit) { cand_key[at + rank] = key; cand_pos[at + rank] = p; }
        at += total;
    }
}

// Levels after the first. Blocks [0, full_blocks) read the tiles of MODE_FULL segments (keys
// recomputed); the others read one buffer chunk each of MODE_BUF segments. Only keys whose
// higher digits equal the prefix so far are counted, by the digit at `shift`.
extern "C" __global__ void psparse_rs_hist(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles,
                                           long long ntiles, long long full_blocks,
                                           const long long* chunks, const long long* segs,
                                           long long* state, const unsigned long long* cand_key,
                                           unsigned int* hist, int shift, int bits) {
    RS_KEY_SRC;
    __shared__ unsigned sh[RS_MAXBINS];
    __shared__ int sh_bad;
    int nb = 1 << bits, above = shift + bits;
    for (int i = threadIdx.x; i < nb; i += RS_THREADS) sh[i] = 0;
    if (threadIdx.x == 0) sh_bad = 0;
    __syncthreads();
    if ((long long)blockIdx.x < full_blocks) {
        long long t0 = (long long)blockIdx.x * ntiles / full_blocks;
        long long t1 = ((long long)blockIdx.x + 1) * ntiles / full_blocks;
        long long current = -1;
        for (long long t = t0; t < t1; t++) {
            long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
            const long long* st = state + seg * ST_W;
            if (st[ST_MODE] != MODE_FULL) continue;
            if (seg != current) {
                if (current >= 0) rs_flush(sh, &sh_bad, nb, current, hist, state);
                current = seg;
            }
            u64 prefix = (u64)st[ST_PREFIX] >> above;
            for (long long p = lo + threadIdx.x; p < hi; p += RS_THREADS) {
                int bad = 0;
                u64 key = rs_key(src, p, seg, &bad);
                if ((key >> above) == prefix)
                    atomicAdd(&sh[(unsigned)(key >> shift) & (unsigned)(nb - 1)], 1u);
            }
        }
        if (current >= 0) rs_flush(sh, &sh_bad, nb, current, hist, state);
        return;
    }
    long long c = (long long)blockIdx.x - full_blocks;
    long long seg = chunks[2 * c], lo = chunks[2 * c + 1];
    const long long* st = state + seg * ST_W;
    if (st[ST_MODE] != MODE_BUF) return;
    long long hi = st[ST_CAND] < lo + RS_TILE ? st[ST_CAND] : lo + RS_TILE;
    const u64* keys = cand_key + segs[seg * SG_W + SG_CBASE];
    u64 prefix = (u64)st[ST_PREFIX] >> above;
    for (long long i = lo + threadIdx.x; i < hi; i += RS_THREADS) {
        u64 key = keys[i];
        if ((key >> above) == prefix)
            atomicAdd(&sh[(unsigned)(key >> shift) & (unsigned)(nb - 1)], 1u);
    }
    rs_flush(sh, &sh_bad, nb, seg, hist, state);
}

// Work unit u: a tile (u < ntiles; MODE_FULL / MODE_ALL segments) or a buffer chunk (MODE_BUF).
__device__ __forceinline__ int rs_unit(long long u, long long ntiles, const long long* tiles,
                                       const long long* chunks, const long long* segs,
                                       const long long* state, long long* seg, long long* lo,
                                       long long* hi, long long* first) {
    int in_buffer = u >= ntiles;
    if (!in_buffer) {
        *seg = tiles[3 * u]; *lo = tiles[3 * u + 1]; *hi = tiles[3 * u + 2];
    } else {
        long long c = u - ntiles;
        *seg = chunks[2 * c]; *lo = chunks[2 * c + 1];
        long long cand = state[*seg * ST_W + ST_CAND];
        *hi = cand < *lo + RS_TILE ? cand : *lo + RS_TILE;
    }
    long long mode = state[*seg * ST_W + ST_MODE];
    const long long* sg = segs + *seg * SG_W;
    *first = in_buffer ? ntiles + sg[SG_CHUNK0] : sg[SG_TILE0];
    if (in_buffer) return mode == MODE_BUF;
    return mode == MODE_FULL || mode == MODE_ALL;
}

// the key of entry i of a unit, its position, and whether it is above / at the threshold
__device__ __forceinline__ void rs_classify(const KeySrc& src, int in_buffer, long long i,
                                            long long seg, const u64* keys, const long long* pos,
                                            long long mode, u64 threshold, int exclude_zero,
                                            long long* p, int* strict, int* tie) {
    int bad = 0;
    u64 key;
    if (in_buffer) { key = keys[i]; *p = pos[i]; }
    else { *p = i; key = mode == MODE_ALL && !exclude_zero ? 1 : rs_key(src, i, seg, &bad); }
    if (mode == MODE_ALL) { *strict = exclude_zero ? key > 0 : 1; *tie = 0; }
    else { *strict = key > threshold; *tie = key == threshold; }
}

// One block per unit: how many keys are above the final threshold, and how many equal it.
extern "C" __global__ void psparse_rs_count_final(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles,
                                                  long long ntiles, const long long* chunks,
                                                  const long long* segs, const long long* state,
                                                  const unsigned long long* cand_key, const long long* cand_pos,
                                                  int exclude_zero, long long* count_a,
                                                  long long* count_b) {
    RS_KEY_SRC;
    __shared__ u64 sh_w[RS_WARPS];
    long long u = blockIdx.x, seg, lo, hi, first;
    if (!rs_unit(u, ntiles, tiles, chunks, segs, state, &seg, &lo, &hi, &first)) {
        if (threadIdx.x == 0) { count_a[u] = 0; count_b[u] = 0; }
        return;
    }
    int in_buffer = u >= ntiles;
    const long long* st = state + seg * ST_W;
    long long mode = st[ST_MODE], base = in_buffer ? segs[seg * SG_W + SG_CBASE] : 0;
    u64 threshold = (u64)st[ST_PREFIX], a = 0, b = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += RS_THREADS) {
        long long p;
        int strict, tie;
        rs_classify(src, in_buffer, base + i, seg, cand_key, cand_pos, mode, threshold,
                    exclude_zero, &p, &strict, &tie);
        a += strict; b += tie;
    }
    u64 ta, tb;
    rs_block_scan(a, sh_w, &ta);
    rs_block_scan(b, sh_w, &tb);
    if (threadIdx.x == 0) { count_a[u] = (long long)ta; count_b[u] = (long long)tb; }
}

// One block per unit: the selected entries in position order, ties at the threshold to the
// lowest positions (the first `need` of them): out_idx = their indices (gathered through
// `gather` if use_gather), out_val = values[index] (write_values), then values[index] and
// velocity[index] zeroed (take, has_velocity): the gather-and-zero of error feedback.
template <class IndexT>
__device__ void rs_write_final(const KeySrc& src, const long long* tiles, long long ntiles,
                               const long long* chunks, const long long* segs,
                               const long long* state, const unsigned long long* cand_key,
                               const long long* cand_pos, int exclude_zero,
                               const long long* off_a, const long long* off_b, IndexT* out_idx,
                               float* out_val, int write_values, float* values, int take,
                               float* velocity, int has_velocity) {
    __shared__ unsigned sh[2 * RS_WARPS];
    long long u = blockIdx.x, seg, lo, hi, first;
    if (!rs_unit(u, ntiles, tiles, chunks, segs, state, &seg, &lo, &hi, &first)) return;
    int in_buffer = u >= ntiles;
    const long long* sg = segs + seg * SG_W;
    const long long* st = state + seg * ST_W;
    long long mode = st[ST_MODE], base = in_buffer ? sg[SG_CBASE] : 0, need = st[ST_NEED];
    u64 threshold = (u64)st[ST_PREFIX];
    long long above = off_a[u] - off_a[first], ties = off_b[u] - off_b[first];
    IndexT* idx_out = out_idx + sg[SG_OBASE];
    float* val_out = out_val + sg[SG_OBASE];
    for (long long r = lo; r < hi; r += RS_THREADS) {
        long long i = r + threadIdx.x, p = 0;
        int strict = 0, tie = 0;
        if (i < hi)
            rs_classify(src, in_buffer, base + i, seg, cand_key, cand_pos, mode, threshold,
                        exclude_zero, &p, &strict, &tie);
        unsigned rs, rt, ts, tt;
        rs_rank2(strict, tie, sh, &rs, &rt, &ts, &tt);
        long long before_tie = ties + rt;
        long long at = above + rs + (before_tie < need ? before_tie : need);
        if ((strict || (tie && before_tie < need)) && at < sg[SG_K]) {  // never past its k
            long long g = src.use_gather ? src.gather[p] : p;
            idx_out[at] = (IndexT)g;
            if (write_values) val_out[at] = values[g];
            if (take) {
                values[g] = 0.0f;
                if (has_velocity) velocity[g] = 0.0f;
            }
        }
        above += ts;
        ties += tt;
    }
}

extern "C" __global__ void psparse_rs_write_final_i64(
        int key_mode, const float* x, const float* aux, const unsigned char* mask,
        const long long* gather, int use_gather, float p0, const float* pdev,
        const long long* tiles, long long ntiles, const long long* chunks,
        const long long* segs, const long long* state, const unsigned long long* cand_key,
        const long long* cand_pos, int exclude_zero, const long long* off_a,
        const long long* off_b, long long* out_idx, float* out_val, int write_values,
        float* values, int take, float* velocity, int has_velocity) {
    RS_KEY_SRC;
    rs_write_final<long long>(src, tiles, ntiles, chunks, segs, state, cand_key, cand_pos,
                              exclude_zero, off_a, off_b, out_idx, out_val, write_values,
                              values, take, velocity, has_velocity);
}

extern "C" __global__ void psparse_rs_write_final_i32(
        int key_mode, const float* x, const float* aux, const unsigned char* mask,
        const long long* gather, int use_gather, float p0, const float* pdev,
        const long long* tiles, long long ntiles, const long long* chunks,
        const long long* segs, const long long* state, const unsigned long long* cand_key,
        const long long* cand_pos, int exclude_zero, const long long* off_a,
        const long long* off_b, int* out_idx, float* out_val, int write_values,
        float* values, int take, float* velocity, int has_velocity) {
    RS_KEY_SRC;
    rs_write_final<int>(src, tiles, ntiles, chunks, segs, state, cand_key, cand_pos,
                        exclude_zero, off_a, off_b, out_idx, out_val, write_values, values,
                        take, velocity, has_velocity);
}
