"""Server aggregation of 8 sparse pushes against one memory copy of the same bytes.

Cases (issue 28's targets): 11.2M entries at density 1% and 25M at 0.1%, N = 8 pushes of k
entries, half of each push shared by all (as ``bench_scale.py --part aggregation``); also LeNet's
61,706 at 1% for scale. Every function below runs interleaved with the others in blocks, so
drift in machine load hits all; the figure is the median wall time over blocks.

* memcpy: ``numpy.copyto`` of the N·k int32 indices and float32 values (the baseline: the
  ratio is the aggregation's throughput as a fraction of memcpy's);
* ours: ``Aggregator.mean``, the compiled blocked kernel (psparse/ops/aggregate/agg_kernels.py), checked
  bit-identical to the numpy reference first;
* numpy: the reference (psparse/ops/aggregate/reference.py, the code before the kernels);
* k-way merge: the alternative the issue names, compiled here: the N sorted lists merged
  head by head, each output's sum formed in rank order;
* scatter floor: every entry added into a cache-sized dense scratch in rank order, block by
  block, no bitmap, no union, nothing read out: no exact rank-order sum can combine the N
  pushes' entries for less than this by a scatter (ours adds each entry straight into its
  output slot instead, found through the bitmap);
* read once: every pushed index and value read once (an integer sum of their bits), nothing
  else.

``--variants`` also times the kernel at each block size (the choice
``agg_kernels.block_bits_for`` makes). Writes ``aggregation_vs_memcpy`` to
benchmarks/results/bench.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import half_shared_pushes as pushes  # noqa: E402
from common import record, table  # noqa: E402

from psparse.ops.aggregate import agg_kernels  # noqa: E402
from psparse.ops.codec import reference  # noqa: E402
from psparse.ops.jit import address_table  # noqa: E402
from psparse.ops.numba_jit import as_pointer  # noqa: E402
from psparse.server.aggregation import Aggregator  # noqa: E402

WORKERS = 8
CASES = [("LeNet-5", 61_706, 0.01), ("11.2M", 11_200_000, 0.01), ("25M", 25_000_000, 0.001)]
TARGET = 0.25  # of memcpy's throughput


@numba.njit(cache=True, nogil=True, error_model="numpy")
def kway_merge(index_addresses, value_addresses, lengths, out_index, out_value):
    """The N sorted lists merged: each step takes the smallest head, sums (rank order) the
    values of every list whose head it is, and advances those lists."""
    n = lengths.size
    none_left = np.iinfo(np.int64).max
    position = np.zeros(n, np.int64)
    head = np.empty(n, np.int64)
    for r in range(n):
        index = numba.carray(as_pointer(index_addresses[r]), (lengths[r],), np.int32)
        head[r] = index[0] if lengths[r] else none_left
    count = 0
    while True:
        smallest = none_left
        for r in range(n):
            smallest = min(smallest, head[r])
        if smallest == none_left:
            return count
        total = np.float32(0.0)
        for r in range(n):
            if head[r] == smallest:
                p = position[r]
                total += numba.carray(as_pointer(value_addresses[r]), (lengths[r],),
                                      np.float32)[p]
                p += 1
                position[r] = p
                index = numba.carray(as_pointer(index_addresses[r]), (lengths[r],), np.int32)
                head[r] = index[p] if p < lengths[r] else none_left
        out_index[count] = smallest
        out_value[count] = total / np.float32(n)
        count += 1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def scatter_floor(index_addresses, value_addresses, lengths, block_bits, scratch):
    """Every entry added into the block's scratch in rank order, as ``sparse_sum`` does, and
    nothing else (no bitmap, no union, no read-out)."""
    n = lengths.size
    block = np.int64(1) << block_bits
    position = np.zeros(n, np.int64)
    lo = np.int64(0)
    while True:
        busy = False
        for r in range(n):
            index = numba.carray(as_pointer(index_addresses[r]), (lengths[r],), np.int32)
            value = numba.carray(as_pointer(value_addresses[r]), (lengths[r],), np.float32)
            p = position[r]
            while p < lengths[r] and index[p] < lo + block:
                scratch[index[p] - lo] += value[p]
                p += 1
            position[r] = p
            busy |= p < lengths[r]
        if not busy:
            return
        lo += block


@numba.njit(cache=True, nogil=True)
def read_once(index_addresses, value_addresses, lengths):
    total = np.uint64(0)
    for r in range(lengths.size):
        index = numba.carray(as_pointer(index_addresses[r]), (lengths[r],), np.int32)
        value = numba.carray(as_pointer(value_addresses[r]), (lengths[r],), np.float32)
        bits = value.view(np.uint32)
        for t in range(lengths[r]):
            total += np.uint64(index[t]) + np.uint64(bits[t])
    return total


def interleaved(fns: dict, blocks: int, reps: int) -> dict:
    """Median over blocks of each function's mean wall time per call, the functions taking
    turns block by block."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t) / reps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", action="store_true",
                        help="also time each block size and read-out mode")
    parser.add_argument("--blocks", type=int, default=9, help="interleaved blocks per case")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows, figures, variant_rows = [], {}, []
    for label, numel, density in CASES:
        k = max(1, round(numel * density))
        idx, val = pushes(rng, numel, k, WORKERS)
        agg = Aggregator(numel)
        union, mean = agg.mean(idx, val)
        ref_union, ref_mean = reference.sparse_mean(np.zeros(numel, np.float32), idx, val)
        identical = bool(np.array_equal(union, ref_union) and union.dtype == ref_union.dtype
                         and mean.tobytes() == ref_mean.tobytes())
        assert identical, f"{label}: the kernel's aggregate differs from the numpy reference"
        src = np.concatenate([np.concatenate(idx).view(np.uint8),
                              np.concatenate(val).view(np.uint8)])
        dst = np.empty_like(src)
        index_addresses, lengths = address_table(idx)
        value_addresses, _ = address_table(val)
        total = int(lengths.sum())
        out_index, out_value = np.empty(total, np.int32), np.empty(total, np.float32)
        bits = agg_kernels.block_bits_for(numel)
        scratch = np.zeros(1 << bits, np.float32)
        accumulator = np.zeros(numel, np.float32)
        assert kway_merge(index_addresses, value_addresses, lengths, out_index, out_value) \
            == union.size and out_value[:union.size].tobytes() == mean.tobytes()
        fns = {"memcpy": lambda: np.copyto(dst, src),
               "ours": lambda: agg.mean(idx, val),
               "numpy": lambda: reference.sparse_mean(accumulator, idx, val),
               "k-way merge": lambda: kway_merge(index_addresses, value_addresses, lengths,
                                                 out_index, out_value),
               "scatter floor": lambda: scatter_floor(index_addresses, value_addresses, lengths,
                                                      bits, scratch),
               "read once": lambda: read_once(index_addresses, value_addresses, lengths)}
        reps = max(1, int(2e6 // total))
        t = interleaved(fns, args.blocks, reps)
        ratio = {name: t["memcpy"] / t[name] for name in t}
        rows.append([label, f"{k:,}", f"{union.size:,}", f"{src.nbytes / 1e6:.2f}",
                     f"{t['memcpy'] * 1e3:.3f}", f"{t['ours'] * 1e3:.3f}",
                     f"{t['numpy'] * 1e3:.2f}", f"{t['k-way merge'] * 1e3:.3f}",
                     f"{t['scatter floor'] * 1e3:.3f}", f"{t['read once'] * 1e3:.3f}",
                     f"{total / t['ours'] / 1e6:.0f}", f"{ratio['ours']:.1%}",
                     f"{ratio['numpy']:.1%}", f"{ratio['k-way merge']:.1%}",
                     f"{ratio['scatter floor']:.1%}", f"{ratio['read once']:.0%}"])
        figures[label] = {
            "numel": numel, "density": density, "pushes": WORKERS, "k": k,
            "union": int(union.size), "bytes": int(src.nbytes), "bit_identical": identical,
            "block_bits": bits,
            "seconds": {name: round(v, 7) for name, v in t.items()},
            "ratio": round(ratio["ours"], 4), "numpy_ratio": round(ratio["numpy"], 4),
            "kway_merge_ratio": round(ratio["k-way merge"], 4),
            "scatter_floor_ratio": round(ratio["scatter floor"], 4),
            "read_once_ratio": round(ratio["read once"], 4),
            "entries_per_s": round(total / t["ours"]),
            "target": TARGET, "met": ratio["ours"] >= TARGET}
        if args.variants:
            variant_rows += variants(label, numel, idx, val, t["memcpy"], args.blocks, reps)
    print(f"Server aggregation of {WORKERS} pushes vs one memcpy of the same bytes (median ms "
          "over interleaved blocks; ratios: throughput as a fraction of memcpy's, this run)")
    print(table(rows, ["case", "k", "union", "MB", "memcpy", "ours", "numpy", "k-way merge",
                       "scatter floor", "read once", "ours M entries/s", "ours/memcpy",
                       "numpy/memcpy", "merge/memcpy", "scatter floor/memcpy",
                       "read once/memcpy"]))
    print(f"target: ours >= {TARGET:.0%} of memcpy at 11.2M/1% and 25M/0.1%; bit-identical "
          "to the numpy reference (checked)")
    if variant_rows:
        print("\nKernel variants (block size), same cases")
        print(table(variant_rows, ["case", "block bits", "ms", "of memcpy"]))
    record({"aggregation_vs_memcpy": {
        "cases": figures, "target": TARGET,
        "met": all(figures[c]["met"] for c in ("11.2M", "25M")),
        "baseline": "numpy.copyto of the pushes' index and value bytes, interleaved"}})
    return 0


def variants(label, numel, idx, val, t_copy, blocks, reps) -> list:
    rows = []
    agg = Aggregator(numel)
    for bits in (13, 15, 16, 17, 18, 20):
        agg_kernels.block_bits_for = lambda *a, b=bits: b
        t = interleaved({"k": lambda: agg.mean(idx, val)}, blocks, reps)["k"]
        rows.append([label, bits, f"{t * 1e3:.3f}", f"{t_copy / t:.1%}"])
    agg_kernels.block_bits_for = BLOCK_BITS_FOR
    return rows


BLOCK_BITS_FOR = agg_kernels.block_bits_for

if __name__ == "__main__":
    sys.exit(main())
