// The device selection engine's CUDA C (psparse/ops/select/radix.py drives it; psparse/ops/sources.py
// loads it). Compiled by CuPy/NVRTC on a GPU, by `make check-kernels` without one, and run on
// the CPU by psparse/backends/kernel_emu.py in the tests.
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
#define ST_DONE 5  // units of the level counted in so far (the fused scan's trigger)
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

// ---- ranks in entry order within a unit --------------------------------------------------
// A unit (a tile of positions, or a chunk of a candidate buffer: RS_TILE entries) is read as
// RS_ITEMS rows of RS_THREADS: item j of thread t is entry j * RS_THREADS + t, so each load is
// coalesced and a thread has several independent loads in flight (the key loops unroll by 4;
// fully unrolled, 16 inlined copies of rs_key per kernel took NVRTC 17 s instead of ~1 s). An
// item's rank among the flagged items, in entry order, is the count in the earlier rows and in
// its row's earlier warps (warp 0 scans the RS_ITEMS x RS_WARPS warp counts) plus its warp's
// earlier lanes: two barriers per unit. ba, bb: the warp's ballots of two flags per row.
#define RS_ROWS (RS_ITEMS * RS_WARPS)
__device__ __forceinline__ void rs_unit_rank(const unsigned* ba, const unsigned* bb,
                                             unsigned* sh_a, unsigned* sh_b, unsigned* ra,
                                             unsigned* rb, unsigned* ta, unsigned* tb) {
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
        for (int j = 0; j < RS_ITEMS; j++) {
            sh_a[j * RS_WARPS + warp] = __popc(ba[j]);
            sh_b[j * RS_WARPS + warp] = __popc(bb[j]);
        }
    __syncthreads();
    if (warp == 0) {  // exclusive prefix of the RS_ROWS counts, in place; totals after them
        const int per = RS_ROWS / 32;
        unsigned sa = 0, sb = 0;
        for (int i = 0; i < per; i++) { sa += sh_a[lane * per + i]; sb += sh_b[lane * per + i]; }
        unsigned xa = sa, xb = sb;
        for (int d = 1; d < 32; d <<= 1) {
            unsigned ya = __shfl_up_sync(0xffffffffu, xa, d);
            unsigned yb = __shfl_up_sync(0xffffffffu, xb, d);
            if ((int)lane >= d) { xa += ya; xb += yb; }
        }
        if (lane == 31) { sh_a[RS_ROWS] = xa; sh_b[RS_ROWS] = xb; }
        unsigned oa = xa - sa, ob = xb - sb;
        for (int i = 0; i < per; i++) {
            unsigned ca = sh_a[lane * per + i], cb = sh_b[lane * per + i];
            sh_a[lane * per + i] = oa; sh_b[lane * per + i] = ob;
            oa += ca; ob += cb;
        }
    }
    __syncthreads();
    unsigned below = (1u << lane) - 1u;
    for (int j = 0; j < RS_ITEMS; j++) {
        ra[j] = sh_a[j * RS_WARPS + warp] + __popc(ba[j] & below);
        rb[j] = sh_b[j * RS_WARPS + warp] + __popc(bb[j] & below);
    }
    *ta = sh_a[RS_ROWS]; *tb = sh_b[RS_ROWS];
}

// ---- units in order, and a prefix over them in the same pass (decoupled look-back) -------
// A block takes the next unit from a ticket counter that is never reset: units are handed out
// in order, so every unit a block waits on belongs to a block already running (none waits on
// one that has not started), and ticket / grid + 1 is the launch's epoch.
__device__ __forceinline__ void rs_ticket(unsigned long long* ticket, long long* unit,
                                          u64* epoch) {
    __shared__ u64 sh_ticket;
    if (threadIdx.x == 0) sh_ticket = atomicAdd(ticket, 1ull);
    __syncthreads();
    *unit = (long long)(sh_ticket % gridDim.x);
    *epoch = sh_ticket / gridDim.x + 1;
}

// One thread: unit u's exclusive prefix of two counts (a, b) over the units [first, u) of its
// segment. It publishes its own counts at once (flag 1), then reads back from u - 1, adding
// counts, until it meets a published inclusive prefix (flag 2; the segment's first unit has
// one at once), and publishes its own. A flag holds its launch's epoch, so a flag of an
// earlier launch reads as not ready and nothing is ever cleared.
__device__ void rs_lookback(long long u, long long first, u64 epoch, long long a, long long b,
                            unsigned long long* flags, long long* aggs, long long* incs,
                            long long* ex_a, long long* ex_b) {
    volatile unsigned long long* vf = flags;
    volatile long long* va = aggs;
    volatile long long* vi = incs;
    long long pa = 0, pb = 0;
    if (u > first) {
        va[2 * u] = a; va[2 * u + 1] = b;
        __threadfence();  // the counts before the flag that says they are there
        vf[u] = (epoch << 2) | 1ull;
        for (long long j = u - 1;; j--) {
            u64 f;
            do { f = vf[j]; } while ((f >> 2) != epoch);
            __threadfence();
            if ((f & 3ull) == 2ull) { pa += vi[2 * j]; pb += vi[2 * j + 1]; break; }
            pa += va[2 * j]; pb += va[2 * j + 1];
        }
    }
    vi[2 * u] = pa + a; vi[2 * u + 1] = pb + b;
    __threadfence();
    vf[u] = (epoch << 2) | 2ull;
    *ex_a = pa; *ex_b = pb;
}

// ---- the threshold digit of a level --------------------------------------------------------
// Segment s, by one block: in the level's histogram, the digit where the count from the top
// reaches what is still needed; the prefix grows by it. Level 0 also decides the mode: the
// candidates (every key in or above that digit) fit the segment's buffer (MODE_BUF) or not
// (MODE_FULL: the next levels read the whole segment). The histogram row is left zeroed.
__device__ void rs_scan_segment(long long s, const long long* segs, long long* state,
                                unsigned int* hist, int level, int shift, int bits, int last,
                                int exclude_zero) {
    __shared__ u64 sh_w[RS_WARPS];
    __shared__ long long found[2];
    const long long* sg = segs + s * SG_W;
    long long* st = state + s * ST_W;
    volatile unsigned* h = hist + s * RS_MAXBINS;  // other blocks' counts: read past L1
    int nb = 1 << bits;
    long long n = sg[SG_HI] - sg[SG_LO], k = sg[SG_K];
    long long mode = level == 0 ? (k <= 0 ? MODE_NONE : (k >= n ? MODE_ALL : MODE_BUF))
                                : st[ST_MODE];
    if (mode == MODE_NONE || mode == MODE_ALL) {
        for (int i = threadIdx.x; i < nb; i += RS_THREADS) h[i] = 0;
        if (threadIdx.x == 0 && level == 0) {
            st[ST_MODE] = mode; st[ST_PREFIX] = 0; st[ST_NEED] = 0; st[ST_CAND] = 0;
        }
        __syncthreads();
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
    __syncthreads();
}

// The block's histogram of `done` units of segment seg is flushed: count them in; the block
// that completes the segment's `expected` units scans its histogram (the others fenced their
// counts before counting themselves in), so a level is one launch, not a histogram and a scan.
__device__ void rs_arrive(long long seg, long long done, long long expected,
                          const long long* segs, long long* state, unsigned int* hist,
                          int level, int shift, int bits, int last, int exclude_zero) {
    __shared__ int sh_last;
    __threadfence();  // every thread's histogram counts before the arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 before = atomicAdd((unsigned long long*)&state[seg * ST_W + ST_DONE], (u64)done);
        sh_last = (long long)before + done == expected;
        if (sh_last) { state[seg * ST_W + ST_DONE] = 0; __threadfence(); }  // for the next launch
    }
    __syncthreads();
    if (sh_last) rs_scan_segment(seg, segs, state, hist, level, shift, bits, last, exclude_zero);
    __syncthreads();
}

// Level 0 over every tile: the histogram of the top digit of each segment's keys, the count of
// non-finite scores, and (accumulate != ACC_NONE) error feedback folded in first, in the same
// pass; the block that completes a segment finds its threshold digit. Blocks take contiguous
// runs of tiles.
extern "C" __global__ void psparse_rs_hist0(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, int accumulate, float* acc, const float* grad, float* velocity,
        const float* filtered, float momentum, const long long* tiles, long long ntiles,
        const long long* segs, long long* state, unsigned int* hist, int shift, int bits,
        int last, int exclude_zero) {
    RS_KEY_SRC;
    __shared__ unsigned sh[RS_MAXBINS];
    __shared__ int sh_bad;
    int nb = 1 << bits;
    for (int i = threadIdx.x; i < nb; i += RS_THREADS) sh[i] = 0;
    if (threadIdx.x == 0) sh_bad = 0;
    __syncthreads();
    long long t0 = (long long)blockIdx.x * ntiles / gridDim.x;
    long long t1 = ((long long)blockIdx.x + 1) * ntiles / gridDim.x;
    long long current = -1, done = 0;
    for (long long t = t0; t < t1; t++) {
        long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
        if (seg != current) {
            if (current >= 0) {
                rs_flush(sh, &sh_bad, nb, current, hist, state);
                rs_arrive(current, done, segs[current * SG_W + SG_NTILES], segs, state, hist,
                          0, shift, bits, last, exclude_zero);
            }
            current = seg; done = 0;
        }
        int selecting = segs[seg * SG_W + SG_K] > 0;
        u64 key[RS_ITEMS];
#pragma unroll 4
        for (int j = 0; j < RS_ITEMS; j++) {  // every load of the tile issued before a count
            long long p = lo + j * RS_THREADS + threadIdx.x;
            key[j] = 0;
            if (p < hi) {
                if (accumulate != ACC_NONE)
                    rs_accumulate(accumulate, use_gather ? gather[p] : p, acc, grad, velocity,
                                  filtered, momentum);
                int bad = 0;
                key[j] = rs_key(src, p, seg, &bad);
                if (bad && selecting) atomicAdd(&sh_bad, 1);  // as the host: selected slices only
            }
        }
#pragma unroll 4
        for (int j = 0; j < RS_ITEMS; j++)
            if (lo + j * RS_THREADS + threadIdx.x < hi)
                atomicAdd(&sh[(unsigned)(key[j] >> shift) & (unsigned)(nb - 1)], 1u);
        done++;
    }
    if (current >= 0) {
        rs_flush(sh, &sh_bad, nb, current, hist, state);
        rs_arrive(current, done, segs[current * SG_W + SG_NTILES], segs, state, hist, 0, shift,
                  bits, last, exclude_zero);
    }
}

// MODE_BUF segments, one block per tile (the second and last pass over every entry): the
// tile's candidates (keys in or above the threshold digit) into the segment's buffer, keys
// and positions, in position order, at the tile's prefix from the look-back.
extern "C" __global__ void psparse_rs_write_cand(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles, const long long* segs,
        const long long* state, unsigned long long* tickets, unsigned long long* flags,
        long long* aggs, long long* incs, unsigned long long* cand_key, long long* cand_pos) {
    RS_KEY_SRC;
    __shared__ unsigned sh_a[RS_ROWS + 1], sh_b[RS_ROWS + 1];
    __shared__ long long sh_at;
    long long t;
    u64 epoch;
    rs_ticket(&tickets[0], &t, &epoch);
    long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
    const long long* sg = segs + seg * SG_W;
    const long long* st = state + seg * ST_W;
    if (st[ST_MODE] != MODE_BUF) return;  // the segment's every tile returns: none waits
    u64 floor = (u64)st[ST_PREFIX], key[RS_ITEMS];
    unsigned ba[RS_ITEMS], bb[RS_ITEMS], ra[RS_ITEMS], rb[RS_ITEMS], ta, tb;
#pragma unroll 4
    for (int j = 0; j < RS_ITEMS; j++) {
        long long p = lo + j * RS_THREADS + threadIdx.x;
        int bad = 0;
        key[j] = p < hi ? rs_key(src, p, seg, &bad) : 0;
    }
    for (int j = 0; j < RS_ITEMS; j++) {
        int hit = lo + j * RS_THREADS + threadIdx.x < hi && key[j] >= floor;
        ba[j] = __ballot_sync(0xffffffffu, hit);
        bb[j] = 0;
    }
    rs_unit_rank(ba, bb, sh_a, sh_b, ra, rb, &ta, &tb);
    if (threadIdx.x == 0) {
        long long before, unused;
        rs_lookback(t, sg[SG_TILE0], epoch, ta, 0, flags, aggs, incs, &before, &unused);
        sh_at = sg[SG_CBASE] + before;
    }
    __syncthreads();
    for (int j = 0; j < RS_ITEMS; j++) {
        long long p = lo + j * RS_THREADS + threadIdx.x;
        if (p < hi && key[j] >= floor) {
            cand_key[sh_at + ra[j]] = key[j];
            cand_pos[sh_at + ra[j]] = p;
        }
    }
}

// Levels after the first. Blocks [0, full_blocks) read the tiles of MODE_FULL segments (keys
// recomputed); the others read one buffer chunk each of MODE_BUF segments. Only keys whose
// higher digits equal the prefix so far are counted, by the digit at `shift`; the block that
// completes a segment finds the level's digit.
extern "C" __global__ void psparse_rs_hist(int key_mode, const float* x, const float* aux,
        const unsigned char* mask, const long long* gather, int use_gather, float p0,
        const float* pdev, const long long* tiles, long long ntiles, long long full_blocks,
        const long long* chunks, const long long* segs, long long* state,
        const unsigned long long* cand_key, unsigned int* hist, int shift, int bits, int level,
        int last, int exclude_zero) {
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
        long long current = -1, done = 0;
        for (long long t = t0; t < t1; t++) {
            long long seg = tiles[3 * t], lo = tiles[3 * t + 1], hi = tiles[3 * t + 2];
            const long long* st = state + seg * ST_W;
            if (st[ST_MODE] != MODE_FULL) continue;  // set at level 0, never changed after
            if (seg != current) {
                if (current >= 0) {
                    rs_flush(sh, &sh_bad, nb, current, hist, state);
                    rs_arrive(current, done, segs[current * SG_W + SG_NTILES], segs, state,
                              hist, level, shift, bits, last, exclude_zero);
                }
                current = seg; done = 0;
            }
            u64 prefix = (u64)st[ST_PREFIX] >> above;
            for (long long p = lo + threadIdx.x; p < hi; p += RS_THREADS) {
                int bad = 0;
                u64 key = rs_key(src, p, seg, &bad);
                if ((key >> above) == prefix)
                    atomicAdd(&sh[(unsigned)(key >> shift) & (unsigned)(nb - 1)], 1u);
            }
            done++;
        }
        if (current >= 0) {
            rs_flush(sh, &sh_bad, nb, current, hist, state);
            rs_arrive(current, done, segs[current * SG_W + SG_NTILES], segs, state, hist,
                      level, shift, bits, last, exclude_zero);
        }
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
    rs_arrive(seg, 1, segs[seg * SG_W + SG_NCHUNKS], segs, state, hist, level, shift, bits,
              last, exclude_zero);
}

// Work unit u: a tile (u < ntiles; MODE_FULL / MODE_ALL segments) or a buffer chunk (MODE_BUF).
// static_mode: every segment takes all or none (the mode is k's, and no histogram ran).
__device__ __forceinline__ int rs_unit(long long u, long long ntiles, const long long* tiles,
                                       const long long* chunks, const long long* segs,
                                       const long long* state, int static_mode, long long* seg,
                                       long long* lo, long long* hi, long long* first,
                                       long long* count, long long* mode) {
    int in_buffer = u >= ntiles;
    if (!in_buffer) {
        *seg = tiles[3 * u]; *lo = tiles[3 * u + 1]; *hi = tiles[3 * u + 2];
    } else {
        long long c = u - ntiles;
        *seg = chunks[2 * c]; *lo = chunks[2 * c + 1];
        long long cand = state[*seg * ST_W + ST_CAND];
        *hi = cand < *lo + RS_TILE ? cand : *lo + RS_TILE;
    }
    const long long* sg = segs + *seg * SG_W;
    *mode = static_mode ? (sg[SG_K] <= 0 ? MODE_NONE : MODE_ALL) : state[*seg * ST_W + ST_MODE];
    *first = in_buffer ? ntiles + sg[SG_CHUNK0] : sg[SG_TILE0];
    *count = in_buffer ? sg[SG_NCHUNKS] : sg[SG_NTILES];
    if (in_buffer) return *mode == MODE_BUF;
    return *mode == MODE_FULL || *mode == MODE_ALL;
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

// One block per unit, in one launch: the selected entries in position order, ties at the
// threshold to the lowest positions (the first `need` of them), at the unit's prefix from the
// look-back: out_idx = their indices (gathered through `gather` if use_gather), out_val =
// values[index] (write_values), then values[index] and velocity[index] zeroed (take,
// has_velocity): the gather-and-zero of error feedback. A segment's last unit writes its
// report (selected, non-finite) and clears the non-finite count for the next call.
template <class IndexT>
__device__ void rs_final(const KeySrc& src, const long long* tiles, long long ntiles,
                         const long long* chunks, const long long* segs, long long* state,
                         const unsigned long long* cand_key, const long long* cand_pos,
                         int exclude_zero, int static_mode, unsigned long long* tickets,
                         unsigned long long* flags, long long* aggs, long long* incs,
                         long long* report, IndexT* out_idx, float* out_val, int write_values,
                         float* values, int take, float* velocity, int has_velocity) {
    __shared__ unsigned sh_a[RS_ROWS + 1], sh_b[RS_ROWS + 1];
    __shared__ long long sh_ex[2];
    long long u, seg, lo, hi, first, count, mode;
    u64 epoch;
    rs_ticket(&tickets[1], &u, &epoch);
    int mine = rs_unit(u, ntiles, tiles, chunks, segs, state, static_mode, &seg, &lo, &hi,
                       &first, &count, &mode);
    const long long* sg = segs + seg * SG_W;
    long long* st = state + seg * ST_W;
    int last_unit = u == first + count - 1;
    if (static_mode && last_unit && threadIdx.x == 0) {  // the state a scan would have left
        st[ST_MODE] = mode; st[ST_PREFIX] = 0; st[ST_NEED] = 0; st[ST_CAND] = 0;
    }
    if (!mine) {  // a selection of none: its last tile reports it
        if (mode == MODE_NONE && u < ntiles && last_unit && threadIdx.x == 0) {
            report[seg * RP_W + RP_OUT] = 0;
            report[seg * RP_W + RP_BAD] = st[ST_BAD];
            st[ST_BAD] = 0;
        }
        return;
    }
    int in_buffer = u >= ntiles;
    long long base = in_buffer ? sg[SG_CBASE] : 0;
    long long need = mode == MODE_ALL ? 0 : st[ST_NEED];
    u64 threshold = mode == MODE_ALL ? 0 : (u64)st[ST_PREFIX];
    long long pos[RS_ITEMS];
    int strict[RS_ITEMS], tie[RS_ITEMS];
    unsigned ba[RS_ITEMS], bb[RS_ITEMS], ra[RS_ITEMS], rb[RS_ITEMS], ta, tb;
#pragma unroll 4
    for (int j = 0; j < RS_ITEMS; j++) {
        long long i = lo + j * RS_THREADS + threadIdx.x;
        pos[j] = 0; strict[j] = 0; tie[j] = 0;
        if (i < hi)
            rs_classify(src, in_buffer, base + i, seg, cand_key, cand_pos, mode, threshold,
                        exclude_zero, &pos[j], &strict[j], &tie[j]);
    }
    for (int j = 0; j < RS_ITEMS; j++) {
        ba[j] = __ballot_sync(0xffffffffu, strict[j]);
        bb[j] = __ballot_sync(0xffffffffu, tie[j]);
    }
    rs_unit_rank(ba, bb, sh_a, sh_b, ra, rb, &ta, &tb);
    if (threadIdx.x == 0) {
        rs_lookback(u, first, epoch, ta, tb, flags, aggs, incs, &sh_ex[0], &sh_ex[1]);
        if (last_unit) {
            long long ties = sh_ex[1] + tb;
            report[seg * RP_W + RP_OUT] = sh_ex[0] + ta + (ties < need ? ties : need);
            report[seg * RP_W + RP_BAD] = st[ST_BAD];
            st[ST_BAD] = 0;
        }
    }
    __syncthreads();
    IndexT* idx_out = out_idx + sg[SG_OBASE];
    float* val_out = out_val + sg[SG_OBASE];
    for (int j = 0; j < RS_ITEMS; j++) {
        long long before_tie = sh_ex[1] + rb[j];
        long long at = sh_ex[0] + ra[j] + (before_tie < need ? before_tie : need);
        if ((strict[j] || (tie[j] && before_tie < need)) && at < sg[SG_K]) {  // never past k
            long long g = src.use_gather ? src.gather[pos[j]] : pos[j];
            idx_out[at] = (IndexT)g;
            if (write_values) val_out[at] = values[g];
            if (take) {
                values[g] = 0.0f;
                if (has_velocity) velocity[g] = 0.0f;
            }
        }
    }
}

extern "C" __global__ void psparse_rs_final_i64(
        int key_mode, const float* x, const float* aux, const unsigned char* mask,
        const long long* gather, int use_gather, float p0, const float* pdev,
        const long long* tiles, long long ntiles, const long long* chunks,
        const long long* segs, long long* state, const unsigned long long* cand_key,
        const long long* cand_pos, int exclude_zero, int static_mode,
        unsigned long long* tickets, unsigned long long* flags, long long* aggs,
        long long* incs, long long* report, long long* out_idx, float* out_val, int write_values,
        float* values, int take, float* velocity, int has_velocity) {
    RS_KEY_SRC;
    rs_final<long long>(src, tiles, ntiles, chunks, segs, state, cand_key, cand_pos, exclude_zero,
                     static_mode, tickets, flags, aggs, incs, report, out_idx, out_val,
                     write_values, values, take, velocity, has_velocity);
}

extern "C" __global__ void psparse_rs_final_i32(
        int key_mode, const float* x, const float* aux, const unsigned char* mask,
        const long long* gather, int use_gather, float p0, const float* pdev,
        const long long* tiles, long long ntiles, const long long* chunks,
        const long long* segs, long long* state, const unsigned long long* cand_key,
        const long long* cand_pos, int exclude_zero, int static_mode,
        unsigned long long* tickets, unsigned long long* flags, long long* aggs,
        long long* incs, long long* report, int* out_idx, float* out_val, int write_values,
        float* values, int take, float* velocity, int has_velocity) {
    RS_KEY_SRC;
    rs_final<int>(src, tiles, ntiles, chunks, segs, state, cand_key, cand_pos, exclude_zero,
                     static_mode, tickets, flags, aggs, incs, report, out_idx, out_val,
                     write_values, values, take, velocity, has_velocity);
}
