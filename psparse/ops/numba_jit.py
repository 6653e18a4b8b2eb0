"""Numba configured before any kernel is defined: the ``@kernel`` decorator and its vector compares.

Numba itself, configured before any kernel is defined: the ``@kernel`` decorator, the
intrinsics the kernels use, and where numba's cache lives (psparse/ops/jit.py's docstring has the
rules; README, "Compiled CPU kernels"). Imported by the kernel modules only."""

from __future__ import annotations

import sys

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .cache import PACKAGE_CACHE, cache_dir_fallback, writable


def _without_scipy_blas_probe() -> None:
    """Import numba.np.arraymath with its BLAS probe answered "none".

    The first compile or cache load of a process imports numba.np.arraymath, which probes for
    BLAS by importing scipy.linalg (~0.15 s where scipy is installed, e.g. with the dev extras)
    for helpers no kernel here uses (without it numba's np.cov-like code takes a plain loop;
    np.dot still finds BLAS, which checks again when used). Where scipy.linalg is loaded
    already, or numba's internals differ, nothing is changed.
    """
    if "scipy.linalg" in sys.modules or "numba.np.arraymath" in sys.modules:
        return
    try:
        from numba.np import linalg
        probe = linalg.ensure_blas
    except (ImportError, AttributeError):
        return

    def no_blas():
        raise ImportError("not probed (psparse.ops.numba_jit)")
    linalg.ensure_blas = no_blas
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        linalg.ensure_blas = probe


_without_scipy_blas_probe()
_fallback = cache_dir_fallback()
if _fallback is not None:
    config.CACHE_DIR = str(_fallback)
CACHING = bool(config.CACHE_DIR) or writable(PACKAGE_CACHE)


def kernel(fn):
    """A compiled CPU kernel: nopython, cached on disk, releases the GIL. error_model="numpy"
    drops Python's divide-by-zero checks from the loops (no kernel divides by zero)."""
    return numba.njit(cache=CACHING, nogil=True, error_model="numpy")(fn)


def inlined(fn):
    """A helper of compiled kernels, inlined into each caller at numba's level (so that the
    caller's loop is optimised as one: a call per element or group left out of line costs
    several times the work it does)."""
    return numba.njit(cache=CACHING, nogil=True, error_model="numpy", inline="always")(fn)


def cache_dir() -> str:
    """Where numba writes this package's compiled kernels."""
    return config.CACHE_DIR or (str(PACKAGE_CACHE) if CACHING else "(not cached)")


@intrinsic
def as_pointer(typingctx, address):
    """int64 address -> void*: with ``numba.carray`` a kernel reads N separate arrays (the
    received frames, left where they are) through one table of addresses."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(address), codegen


@intrinsic
def trailing_zeros(typingctx, word):
    """Count of trailing zero bits of an unsigned 64-bit word (64 for 0): one tzcnt."""
    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))
    return types.uint64(types.uint64), codegen


@intrinsic
def population_count(typingctx, word):
    """Count of set bits of an unsigned 64-bit word: one popcnt."""
    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


MASK_LANES = 16  # float32s that ``magnitude_mask`` compares at once: one 64-byte cache line


@intrinsic
def magnitude_mask(typingctx, address, low, high):
    """Bit i set where low <= |x_i| <= high for the 16 float32s x_0..x_15 at byte ``address``,
    compared as bits (``low``/``high``: the uint32 bits of non-negative floats; NaN's bits lie
    above inf's, so high = inf's bits leaves NaN out).

    Written as one vector compare in LLVM's IR (a 16-lane load, AND, two unsigned compares,
    the 16 results as a 16-bit integer): numba's own loops widen integer arithmetic to 64 bits
    and spell a per-element compare as scalar code, ~3x slower than a plain read of the same
    memory; this one runs at the read's speed (on AVX-512 a load, an AND, two compares into a
    mask register and a move out of it; other targets get LLVM's lowering of the same IR).
    """
    def codegen(context, builder, signature, args):
        start, lo, hi = args
        word = ir.IntType(32)
        vector = ir.VectorType(word, MASK_LANES)
        values = builder.load(builder.inttoptr(start, vector.as_pointer()), align=4)
        values = builder.and_(values, ir.Constant(vector, [0x7FFFFFFF] * MASK_LANES))

        def splat(scalar):
            lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar,
                                           ir.Constant(word, 0))
            return builder.shuffle_vector(lane0, ir.Constant(vector, ir.Undefined),
                                          ir.Constant(vector, [0] * MASK_LANES))
        inside = builder.and_(builder.icmp_unsigned(">=", values, splat(lo)),
                              builder.icmp_unsigned("<=", values, splat(hi)))
        return builder.zext(builder.bitcast(inside, ir.IntType(MASK_LANES)), ir.IntType(64))
    return types.uint64(types.int64, types.uint32, types.uint32), codegen


def _not_increasing_mask(width: int):
    """An intrinsic for ``width``-bit signed integers: bit i set where x[i + 1] <= x[i], for
    the 512 / width lanes x_0.. at byte ``address`` (reads one value more than it has lanes).
    A received index frame's order check at a plain read's speed (numba's loop over the same
    compare ran at a third of it)."""
    lanes = 512 // width

    @intrinsic
    def not_increasing(typingctx, address):
        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.IntType(width), lanes)
            here = builder.load(builder.inttoptr(args[0], vector.as_pointer()), align=1)
            after = builder.load(builder.inttoptr(
                builder.add(args[0], ir.Constant(ir.IntType(64), width // 8)),
                vector.as_pointer()), align=1)
            bad = builder.icmp_signed("<=", after, here)
            return builder.zext(builder.bitcast(bad, ir.IntType(lanes)), ir.IntType(64))
        return types.uint64(types.int64), codegen
    return not_increasing


not_increasing_32 = _not_increasing_mask(32)  # 16 int32 lanes
not_increasing_64 = _not_increasing_mask(64)  # 8 int64 lanes


def _continued_run_mask(run: int):
    """An intrinsic: bit i set where the ``run`` bytes from byte ``address`` + i all have their
    top bit (a varint's continuation bit), for the 64 starting positions i < 64 (reads 63 +
    run bytes). A delta frame's wide-varint test: one AND of ``run`` shifted 64-byte loads."""
    @intrinsic
    def continued(typingctx, address):
        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.IntType(8), 64)
            every = None
            for offset in range(run):
                at = builder.add(args[0], ir.Constant(ir.IntType(64), offset))
                data = builder.load(builder.inttoptr(at, vector.as_pointer()), align=1)
                every = data if every is None else builder.and_(every, data)
            top = builder.icmp_unsigned(">=", every, ir.Constant(vector, [0x80] * 64))
            return builder.bitcast(top, ir.IntType(64))
        return types.uint64(types.int64), codegen
    return continued


continued_5 = _continued_run_mask(5)  # a group at bit 35 or above: int32 output may not hold it
continued_9 = _continued_run_mask(9)  # a 10-byte varint
