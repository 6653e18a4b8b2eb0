"""The compiled CPU kernels' one-time cost: first-call compilation against a load from numba's
cache, each in a fresh process (``python -m psparse.ops.jit``: every kernel for every argument type
the package passes, psparse/ops/jit.py's ``warm_up``).

1. compile: an empty NUMBA_CACHE_DIR, so every kernel is compiled (and written to it);
2. cache load: a second process with the same directory, so every kernel is loaded;
3. the process start itself (importing psparse.server without touching a kernel), for scale.

Writes ``kernel_compile_s`` and ``kernel_cache_load_s`` to benchmarks/results/bench.json.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402


def timed(code: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True,
                         check=True).stdout
    return time.perf_counter() - t, out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="psparse-numba-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        wall_compile, out_compile = timed(["-m", "psparse.ops.jit"], env)
        wall_load, out_load = timed(["-m", "psparse.ops.jit"], env)
        wall_import, _ = timed(["-c", "import psparse.server"], env)
    inside = [float(re.search(r"all kernels: ([\d.]+) s", o).group(1))
              for o in (out_compile, out_load)]
    print(out_load.splitlines()[0].replace(cache, "(a fresh temporary NUMBA_CACHE_DIR)"))
    print(f"first call, compiling every kernel: {inside[0]:.2f} s inside the process "
          f"({wall_compile:.2f} s with its start)")
    print(f"first call, loading every kernel from the cache: {inside[1]:.2f} s inside the "
          f"process ({wall_load:.2f} s with its start); a process importing psparse.server "
          f"and nothing else: {wall_import:.2f} s")
    record({"kernel_compile_s": {"seconds": round(inside[0], 3),
                                 "process_s": round(wall_compile, 3)},
            "kernel_cache_load_s": {"seconds": round(inside[1], 3),
                                    "process_s": round(wall_load, 3),
                                    "import_only_process_s": round(wall_import, 3)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
