"""Value formats (--values): encoding + decoding cost per entry against a memcpy.

For 1M and 10M float32 values (gradient-like: normal, over a few binades): a value format's
``pack`` (the frame a push or an aggregate sends) and ``unpack`` (the receiver's float32
values, checked) of bf16, fp16, int8 and int4 at the default block of 128, against
``numpy.copyto`` of the same float32 values (4 bytes per entry; the physical floor of any pass
that reads them and writes a result), like for like in two ways:

- *reused*: pack and unpack into buffers that already exist (``out=``), against a copy into an
  existing array: the coding passes themselves;
- *fresh*: pack and unpack as the wire calls them (each makes its frame or values anew),
  against a copy into a new array (``numpy.copy``): what a receiver that keeps its message
  pays. Above glibc's mmap threshold (32 MiB: the 10M values) every new array is fresh pages,
  and the page faults cost as much as the copy itself, on both sides.

Interleaved blocks, medians. Ratio: memcpy's time over the format's pack + unpack time (1.0 = a
coding pass as fast as copying the values once). Target: int8 >= 0.5 on the host. At 1M
everything is in cache and memcpy runs at cache speed: the coding passes are compute-bound
there. Writes ``values_vs_memcpy`` to benchmarks/results/bench.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import interleaved_medians, record, table  # noqa: E402

from psparse.ops.values.formats import ValueFormat, unpack  # noqa: E402

SIZES = (1_000_000, 10_000_000)
FORMATS = ("bf16", "fp16", "int8", "int4")
TARGET = 0.5  # int8's pack + unpack throughput as a fraction of memcpy's


def main() -> int:
    rng = np.random.default_rng(0)
    rows, results = [], {}
    for n in SIZES:
        values = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n))).astype(np.float32)
        dst = np.empty_like(values)
        for name in FORMATS:
            fmt = ValueFormat.named(name)
            frame = fmt.pack(values)  # (also compiles or loads the kernels)
            decoded = unpack(frame, fmt.dtype, n, fmt.block)

            def reused():
                unpack(fmt.pack(values, out=frame), fmt.dtype, n, fmt.block, out=decoded)

            def fresh():
                unpack(fmt.pack(values), fmt.dtype, n, fmt.block)
            repeats = 7 if n < 5_000_000 else 3
            copy_reused, ours_reused = interleaved_medians(
                lambda: np.copyto(dst, values), reused, repeats=repeats)
            copy_fresh, ours_fresh = interleaved_medians(
                lambda: np.copy(values), fresh, repeats=repeats)
            entry = {"bytes_per_entry": round(frame.nbytes / n, 4)}
            for how, copy, ours in (("reused", copy_reused, ours_reused),
                                    ("fresh", copy_fresh, ours_fresh)):
                entry[how] = {"memcpy_ns_per_entry": round(copy / n * 1e9, 3),
                              "pack_unpack_ns_per_entry": round(ours / n * 1e9, 3),
                              "vs_memcpy": round(copy / ours, 3)}
                rows.append([f"{n / 1e6:g}M", name, how, f"{frame.nbytes / n:.3f}",
                             f"{copy / n * 1e9:.2f}", f"{ours / n * 1e9:.2f}",
                             f"{copy / ours:.2f}"])
            results[f"{name}_{n // 1_000_000}m"] = entry
    print("Value formats: pack + unpack per entry vs a memcpy of the float32 values, like for "
          "like (reused: into existing buffers; fresh: new arrays on both sides); median ns "
          "per entry over interleaved blocks; ratio: memcpy / ours, this run")
    print(table(rows, ["values", "format", "buffers", "bytes/entry", "memcpy ns",
                       "pack+unpack ns", "vs memcpy"]))
    for how in ("reused", "fresh"):
        got = {n: results[f"int8_{n // 1_000_000}m"][how]["vs_memcpy"] for n in SIZES}
        print(f"int8 target >= {TARGET} of memcpy, {how} buffers: " + ", ".join(
            f"{n / 1e6:g}M {r:.2f} ({'met' if r >= TARGET else 'missed'})"
            for n, r in got.items()))
    record({"values_vs_memcpy": {**results, "target_int8": TARGET}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
