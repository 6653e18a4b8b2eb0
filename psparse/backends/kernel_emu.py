"""The CUDA kernels run on the CPU: a small emulator, so their logic is tested without a GPU.

``make check-kernels`` proves that every kernel compiles (NVRTC, no GPU); this module proves
that they compute the right thing. The same CUDA C text the GPU runs is compiled by the host's
C++ compiler against a header (``EMU_HEADER``) that supplies what CUDA provides:

* a kernel launch runs its blocks one after another; inside a block every CUDA thread is a
  *fiber* (its own stack, switched cooperatively on one OS thread), so ``__syncthreads`` and
  the warp collectives (``__ballot_sync``, ``__shfl*_sync``, ``__syncwarp``) really wait for
  the other threads, and shared memory (``__shared__``) is shared by the block;
* the fibers of a block run in order (or in reverse, ``reverse=True``) and each runs until it
  reaches a barrier: a kernel that reads shared memory another thread writes without a barrier
  in between reads it before it is written, so a missing ``__syncthreads`` shows as a wrong
  answer, not as a lucky one;
* a barrier some threads never reach (a divergent ``__syncthreads``, or one after some threads
  have returned), or threads waiting at different ``__syncthreads`` (told apart by source
  line), is reported as a deadlock naming the kernel: stricter than the hardware, where both
  are undefined behaviour;
* atomics are plain read-modify-writes (one fiber runs at a time), ``__threadfence`` is a
  no-op, floating-point is IEEE single with no fused multiply-add (``-ffp-contract=off``),
  as the kernels' ``_rn`` intrinsics ask of the GPU.

What it does not show: races between blocks (blocks never overlap here), timing, and memory
faults past an array's end (arrays are host memory: ``EmulatedKernels`` copies each argument
between guard bytes for the launch and names the argument whose guard a kernel wrote).

Arrays are numpy arrays (host memory standing in for device memory); ``launch`` takes the
arguments a CuPy ``RawKernel`` call would, checked against the C signature the same way
(``sources.check_launch``). The compiled library is cached under ``PSPARSE_CACHE`` (default
``~/.cache/psparse``) by a hash of the source.

    emu = EmulatedKernels(sources.CUDA_SOURCE)
    emu.launch("psparse_take", grid, block, (indices, n, acc, numel, velocity, flag, out))
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..ops import sources

EMU_HEADER = r"""
// ---- psparse CUDA emulation header (psparse/backends/kernel_emu.py) ------------------------------
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <csetjmp>
#include <cstdlib>
#include <ucontext.h>
#include <functional>
#include <algorithm>

struct dim3 { unsigned x, y, z; };
struct EmuFiber { ucontext_t uc; jmp_buf jb; int state; int started; int site; };
enum { EMU_RUN = 0, EMU_BLOCK_WAIT = 1, EMU_WARP_WAIT = 2, EMU_DONE = 3 };
static const int EMU_STACK = 256 * 1024;
static const int EMU_MAX_THREADS = 1024;
static EmuFiber emu_fibers[EMU_MAX_THREADS];
static char* emu_stacks[EMU_MAX_THREADS];
static jmp_buf emu_sched;
static int emu_current = 0;
static dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
static unsigned long long emu_warp_slot[EMU_MAX_THREADS];
static const std::function<void()>* emu_body = nullptr;
static char emu_error[512];

static inline dim3 emu_tid() { dim3 d = {(unsigned)emu_current, 0, 0}; return d; }
#define threadIdx (emu_tid())
#define blockIdx (emu_block_idx)
#define blockDim (emu_block_dim)
#define gridDim (emu_grid_dim)
#define warpSize 32
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __restrict__
#define __launch_bounds__(...)

static void emu_yield(int state, int site = 0) {
    EmuFiber& f = emu_fibers[emu_current];
    f.state = state;
    f.site = site;
    if (!_setjmp(f.jb)) _longjmp(emu_sched, 1);
}
// each __syncthreads is told apart by its source line: a block's threads must meet at the same
// one, with none of them gone (stricter than the hardware, which leaves both undefined)
static inline void emu_syncthreads(int line) { emu_yield(EMU_BLOCK_WAIT, line); }
#define __syncthreads() emu_syncthreads(__LINE__)
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; emu_yield(EMU_WARP_WAIT); }
static inline void __threadfence() {}
static inline void __threadfence_block() {}

// warp collectives: every lane writes its value, the warp meets, every lane reads, it meets again
template <class T> static inline unsigned long long emu_bits(T v) {
    unsigned long long b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <class T> static inline T emu_from(unsigned long long b) {
    T v; std::memcpy(&v, &b, sizeof(T)); return v; }
template <class T> static inline T emu_exchange(T v, int src) {
    int lane = emu_current % 32, base = emu_current - lane;
    emu_warp_slot[emu_current] = emu_bits(v);
    __syncwarp();
    T r = (src >= 0 && src < 32 && base + src < (int)emu_block_dim.x) ?
        emu_from<T>(emu_warp_slot[base + src]) : v;
    __syncwarp();
    return r;
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    (void)mask;
    int lane = emu_current % 32, base = emu_current - lane;
    emu_warp_slot[emu_current] = pred ? 1ull : 0ull;
    __syncwarp();
    unsigned r = 0;
    for (int l = 0; l < 32 && base + l < (int)emu_block_dim.x; l++)
        if (emu_fibers[base + l].state != EMU_DONE && emu_warp_slot[base + l]) r |= 1u << l;
    __syncwarp();
    return r;
}
template <class T> static inline T __shfl_sync(unsigned m, T v, int src, int w = 32) {
    (void)m; (void)w; return emu_exchange(v, src); }
template <class T> static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
    (void)m; (void)w; int lane = emu_current % 32;
    T r = emu_exchange(v, lane - (int)d); return lane >= (int)d ? r : v; }
template <class T> static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
    (void)m; (void)w; int lane = emu_current % 32;
    T r = emu_exchange(v, lane + (int)d); return lane + (int)d < 32 ? r : v; }
template <class T> static inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) {
    (void)m; (void)w; return emu_exchange(v, (emu_current % 32) ^ x); }

// one fiber runs at a time: an atomic is a plain read-modify-write
template <class T> static inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> static inline T atomicMax(T* p, T v) { T o = *p; if (v > o) *p = v; return o; }
template <class T> static inline T atomicMin(T* p, T v) { T o = *p; if (v < o) *p = v; return o; }
template <class T> static inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> static inline T atomicCAS(T* p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }
template <class T> static inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }

static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
static inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
static inline int __ffs(unsigned v) { return __builtin_ffs(v); }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // nearest even
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32); }
template <class T> static inline T __ldg(const T* p) { return *p; }
using std::min; using std::max; using std::isfinite; using std::isnan; using std::isinf;

static void emu_trampoline() {
    (*emu_body)();
    emu_fibers[emu_current].state = EMU_DONE;
    _longjmp(emu_sched, 1);
}

// runs one launch: grid blocks in order, each block's threads as fibers; 0 or an error code
static int emu_run(const char* name, unsigned grid, unsigned block, int reverse,
                   const std::function<void()>& body) {
    if (block == 0 || block > EMU_MAX_THREADS || block % 32) {
        std::snprintf(emu_error, sizeof emu_error, "%s: block of %u threads (the emulator "
                      "takes multiples of 32 up to %d)", name, block, EMU_MAX_THREADS);
        return 1;
    }
    emu_body = &body;
    emu_grid_dim = {grid, 1, 1};
    emu_block_dim = {block, 1, 1};
    for (unsigned t = 0; t < block; t++)
        if (!emu_stacks[t]) emu_stacks[t] = (char*)std::malloc(EMU_STACK);
    for (unsigned b = 0; b < grid; b++) {
        emu_block_idx = {b, 0, 0};
        for (unsigned t = 0; t < block; t++) {
            EmuFiber& f = emu_fibers[t];
            f.state = EMU_RUN; f.started = 0;
            getcontext(&f.uc);
            f.uc.uc_stack.ss_sp = emu_stacks[t];
            f.uc.uc_stack.ss_size = EMU_STACK;
            f.uc.uc_link = nullptr;
            makecontext(&f.uc, emu_trampoline, 0);
        }
        for (;;) {
            bool ran = false;
            for (unsigned i = 0; i < block; i++) {
                unsigned t = reverse ? block - 1 - i : i;
                EmuFiber& f = emu_fibers[t];
                if (f.state != EMU_RUN) continue;
                ran = true;
                emu_current = (int)t;
                if (!_setjmp(emu_sched)) {
                    if (!f.started) { f.started = 1; setcontext(&f.uc); }
                    else _longjmp(f.jb, 1);
                }
            }
            if (ran) continue;
            // nobody can run: release every warp whose live lanes all wait at the warp barrier,
            // else the block if every live thread waits at __syncthreads
            bool released = false, all_done = true, mixed = false;
            for (unsigned w = 0; w < block; w += 32) {
                int waiting = 0, live = 0;
                for (unsigned t = w; t < w + 32; t++) {
                    int s = emu_fibers[t].state;
                    if (s != EMU_DONE) live++;
                    if (s == EMU_WARP_WAIT) waiting++;
                }
                if (live) all_done = false;
                if (waiting && waiting == live) {
                    for (unsigned t = w; t < w + 32; t++)
                        if (emu_fibers[t].state == EMU_WARP_WAIT) emu_fibers[t].state = EMU_RUN;
                    released = true;
                } else if (waiting) mixed = true;
            }
            if (all_done) break;
            if (released) continue;
            int at_block = 0, live = 0, site = -1, sites = 0;
            for (unsigned t = 0; t < block; t++) {
                if (emu_fibers[t].state != EMU_DONE) live++;
                if (emu_fibers[t].state == EMU_BLOCK_WAIT) {
                    at_block++;
                    if (emu_fibers[t].site != site) { sites += site != emu_fibers[t].site; site = emu_fibers[t].site; }
                }
            }
            if (!mixed && at_block == live && live == (int)block && sites == 1) {
                for (unsigned t = 0; t < block; t++) emu_fibers[t].state = EMU_RUN;
                continue;
            }
            if (!mixed && at_block == live && sites == 1)
                std::snprintf(emu_error, sizeof emu_error, "%s: deadlock in block %u: %d of %u "
                              "threads returned while the others wait at the __syncthreads of "
                              "line %d (a barrier after a divergent return)", name, b,
                              (int)block - live, block, site);
            else if (!mixed && at_block == live)
                std::snprintf(emu_error, sizeof emu_error, "%s: deadlock in block %u: threads "
                              "wait at different __syncthreads (lines %d and others: a barrier "
                              "inside a divergent branch)", name, b, site);
            else
                std::snprintf(emu_error, sizeof emu_error, "%s: deadlock in block %u: %d of %d "
                              "live threads wait at __syncthreads, the others at a warp "
                              "collective (a barrier inside a divergent branch)", name, b,
                              at_block, live);
            return 2;
        }
    }
    return 0;
}
extern "C" const char* emu_last_error() { return emu_error; }
// ---- end of the emulation header ----------------------------------------------------------
"""

PAD = 64  # guard bytes before and after every array handed to a kernel
_LOCK = threading.Lock()  # the emulator's state is global: one launch at a time per process
GUARD = 0xA5
_CTYPES = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float64): ctypes.c_double,
           np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.uint32): ctypes.c_uint32}


class EmulatorError(RuntimeError):
    """A kernel deadlocked, or wrote outside an array it was given; the text names it."""


def cache_dir() -> Path:
    return Path(os.environ.get("PSPARSE_CACHE", Path.home() / ".cache" / "psparse")) / "emu"


def wrapper_source(source: str) -> str:
    """The launch wrappers: ``emu_launch_NAME(grid, block, reverse, args)`` per kernel, each
    unpacking ``args`` (pointers to each argument's value) by the kernel's C signature."""
    out = []
    for name, params in sources.kernel_signatures(source).items():
        unpack = ", ".join(f"*({ctype}*)a[{i}]" for i, (ctype, _) in enumerate(params))
        out.append(f'extern "C" int emu_launch_{name}(unsigned g, unsigned b, int r, void** a) '
                   f'{{ return emu_run("{name}", g, b, r, [=] {{ {name}({unpack}); }}); }}')
    return "\n".join(out)


def compile_library(source: str, compiler: str | None = None) -> Path:
    """The emulated kernels of ``source`` as a shared library (compiled once, cached)."""
    text = EMU_HEADER + "\n#line 1 \"cuda_source\"\n" + source + "\n" + wrapper_source(source)
    digest = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
    target = cache_dir() / f"kernels-{digest}.so"
    if target.is_file():
        return target
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise EmulatorError("the kernel emulator needs a C++20 compiler (g++); none found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "emu.cpp"
        src.write_text(text)
        built = Path(tmp) / "emu.so"
        done = subprocess.run([compiler, "-std=c++20", "-O1", "-g0", "-fPIC", "-shared",
                               "-ffp-contract=off", "-fno-strict-aliasing", "-w", "-o",
                               str(built), str(src)], capture_output=True, text=True)
        if done.returncode:
            raise EmulatorError(f"compiling the emulated kernels failed:\n{done.stderr[-4000:]}")
        os.replace(built, target)  # atomic: concurrent test processes may build it too
    return target


class EmulatedKernels:
    """The kernels of a CUDA C source, launched on the CPU (see the module docstring)."""

    def __init__(self, source: str = sources.CUDA_SOURCE, reverse: bool = False):
        self.source = source
        self.signatures = sources.kernel_signatures(source)
        self.lib = ctypes.CDLL(str(compile_library(source)))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.reverse = reverse
        self.launches: list[str] = []  # every kernel launched, in order (tests read it)

    def launch(self, name: str, grid: int, block: int, args: tuple) -> None:
        sources.check_launch(name, args, self.signatures[name])
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        regions = _Region.cover(arrays)
        values = []
        for arg in args:
            if isinstance(arg, np.ndarray):
                values.append(ctypes.c_void_p(_Region.pointer(regions, arg)))
            else:
                values.append(_CTYPES[np.dtype(arg.dtype)](arg))
        pointers = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        with _LOCK:
            code = getattr(self.lib, f"emu_launch_{name}")(
                ctypes.c_uint(grid), ctypes.c_uint(block), ctypes.c_int(int(self.reverse)),
                pointers)
            error = self.lib.emu_last_error().decode() if code else ""
        self.launches.append(name)
        faults = [r.release() for r in regions]
        if code:
            raise EmulatorError(error)
        for region, fault in zip(regions, faults):
            if fault:
                names = [p for a, (_, p) in zip(args, self.signatures[name])
                         if isinstance(a, np.ndarray) and region.holds(a)]
                raise EmulatorError(f"{name}: wrote {fault} of the array passed as "
                                    f"{' / '.join(names)}")


class _Region:
    """A span of memory that one or more kernel arguments lie in (aliases and overlapping
    views share one), copied between guard bytes for one launch and back after it, so that
    a write past either end is found instead of corrupting memory."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        size = end - start
        self.buffer = np.full(size + 2 * PAD, GUARD, dtype=np.uint8)
        self.host = (ctypes.c_ubyte * size).from_address(start) if size else None
        if size:
            self.buffer[PAD:PAD + size] = np.frombuffer(self.host, dtype=np.uint8)
        self.base = self.buffer.ctypes.data + PAD

    @staticmethod
    def cover(arrays: list) -> list[_Region]:
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [_Region(lo, hi) for lo, hi in merged]

    def holds(self, array: np.ndarray) -> bool:
        return self.start <= array.ctypes.data and array.ctypes.data + array.nbytes <= self.end

    @staticmethod
    def pointer(regions: list[_Region], array: np.ndarray) -> int:
        for region in regions:
            if region.holds(array):
                return region.base + array.ctypes.data - region.start
        raise AssertionError("an array outside every region")

    def release(self) -> str:
        size = self.end - self.start
        before = np.flatnonzero(self.buffer[:PAD] != GUARD)
        after = np.flatnonzero(self.buffer[PAD + size:] != GUARD)
        if size:
            np.frombuffer(self.host, dtype=np.uint8)[...] = self.buffer[PAD:PAD + size]
        if before.size:
            return f"{PAD - before[0]} byte(s) before the start"
        if after.size:
            return f"{after[-1] + 1} byte(s) past the end"
        return ""
