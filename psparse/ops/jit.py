"""The CPU kernels' loader: modules loaded on first use, the warm-up, the cache's stamp.

This module is the package's side of them and imports no numba (``psparse/ops/numba_jit.py``
does, and only the kernel modules import that): ``LazyModule`` loads a kernel module on first
use, ``warm_up`` compiles or loads them all, ``Reusable`` and ``address_table`` serve their
callers.

The design: one numpy reference per hot step (the code the kernels replaced, kept as their
test oracle) and one compiled kernel per device -- numba on the CPU, CUDA C on the GPU -- side
by side in the operation's folder under psparse/ops/ (``KERNEL_MODULES`` names the numba ones;
psparse/ops/__init__.py lists every operation's files). Every CPU
kernel is ``@kernel``: ``numba.njit(cache=True, nogil=True)``, so it is compiled once per machine
and argument types and then loaded from numba's on-disk cache.

Where the cache lives (docs/architecture.md, "Compiled CPU kernels"): ``NUMBA_CACHE_DIR`` when it is
set; else numba's own choice, ``__pycache__`` beside each kernel source when psparse/ops/ is
writable (an editable install: every process of a run or a test session shares it; the stamp and
the warm-up's locks are in ``psparse/ops/__pycache__``); else, for a read-only
install, ``$XDG_CACHE_HOME/psparse/numba`` (``~/.cache/psparse/numba``), and where even that cannot
be written, ``<tmp>/psparse-numba-<uid>``. ``python -m psparse.ops.jit`` compiles every kernel (or
loads it) and prints the times, e.g. to fill the cache while building an image.

Compilation is paid once per machine: ``psparse-launch`` calls ``prepare()`` before it forks
the server and the workers. That compiles every kernel when the cache lacks them (``warm_up``,
then a stamp in the cache says so) and otherwise only starts numba (its import and first-call
initialisation, ~0.45 s, inherited by the children), each child loading from the cache just
the kernels it runs (~5 ms each; all of them, every argument type, cost ~0.5 s more).

Small calls in a process without numba: a process started alone (a server, a worker, as the
tests start them) whose every payload is small (below ``SMALL`` entries a call) runs the numpy
references for the index coding, the frame checks and the server's sum, which give the same
bytes and dtypes there (``tests/test_small_calls.py``), and never imports numba (0.6-1
CPU-seconds a process: import, initialisation and cache loads). The first call at or above
``SMALL``, or any call once numba is loaded (a launched run, a test session), runs the kernel.

``PSPARSE_CPU_KERNELS=numpy`` runs the numpy references instead of the kernels for the
server's arithmetic (aggregation.py), the index coding (codec.py), the frame checks
(wire/protocol.py) and the host's selection and policy state (sparsify.py, selection.py,
updates.py, policies/) -- slow; for checking a result against the reference, as
tests/test_identical_runs.py does. (The shards' split and merge in client.py, plain integer
copies, always run compiled; tests/test_cpu_kernels.py holds them to their reference.)
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np

REFERENCE = os.environ.get("PSPARSE_CPU_KERNELS", "").strip().lower() == "numpy"
SMALL = 8192  # entries a call: below this the reference costs less than loading numba
# the numba kernel modules by short name, each in its operation's folder
KERNEL_MODULES = {"select_kernels": "psparse.ops.select.select_kernels",
                  "agg_kernels": "psparse.ops.aggregate.agg_kernels",
                  "codec_kernels": "psparse.ops.codec.codec_kernels",
                  "value_kernels": "psparse.ops.values.value_kernels"}


def compiled(entries: int) -> bool:
    """Whether a call over ``entries`` entries runs the kernel (the module docstring's rule):
    always once numba is loaded in this process, else from ``SMALL`` entries on."""
    return not REFERENCE and (entries >= SMALL or "numba" in sys.modules)


class LazyModule:
    """A kernel module imported on first use: a process that runs no kernel (a --help, an
    analysis command, a launch refused for its options, a server that only sees registers)
    never imports numba (~0.25 s) or loads anything from its cache (~0.2 s more)."""

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attribute: str):  # called for the module's names only
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)


def host_compiled(*arrays) -> bool:
    """Whether the host's compiled selection and policy kernels (select_kernels) take these
    arrays: numpy, C-contiguous, float32 (an accumulator, a policy's state), unless
    ``PSPARSE_CPU_KERNELS=numpy`` asks for the references; by ``compiled``'s rule, small
    arrays in a process without numba run the references (the same answers)."""
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
               for a in arrays) and compiled(max((a.size for a in arrays), default=0))


def cache_dir() -> str:
    """Where numba writes this package's compiled kernels."""
    from . import numba_jit
    return numba_jit.cache_dir()


def address_table(arrays: list) -> tuple[np.ndarray, np.ndarray]:
    """(int64 data addresses, int64 lengths) of 1-D contiguous arrays, for ``as_pointer``.
    The caller keeps the arrays alive while a kernel reads them."""
    addresses = np.fromiter((a.__array_interface__["data"][0] for a in arrays), np.int64,
                            len(arrays))
    lengths = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
    return addresses, lengths


class Reusable:
    """Kernel output arrays reused once nothing else holds them.

    What a kernel returns is a view of one of these (a round's aggregate, a decoded index
    frame); it may be sent without a copy (ZeroMQ holds a reference until the frame is on the
    wire) or held by a key cache. An array whose only references are the pool's is free
    again: reusing it spares the page faults of fresh memory (a fresh 7 MB output costs ~2 ms
    of faults at 11.2M/1%, about what the sum itself costs)."""

    def __init__(self, keep: int = 4):
        self.keep = keep  # arrays held for reuse; beyond that, fresh ones
        self._arrays: list[np.ndarray] = []

    def take(self, size: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        for n, array in enumerate(self._arrays):
            # references: the list, the loop variable, getrefcount's argument
            # the cheapest test first: most arrays are held (a key cache, a message in flight)
            if sys.getrefcount(array) <= 3 and array.size >= size and array.dtype == dtype:
                self._arrays.append(self._arrays.pop(n))  # most recently used last
                return array
        array = np.empty(size, dtype)
        self._arrays.append(array)
        if len(self._arrays) > self.keep:
            self._arrays.pop(0)
        return array


def warm_up(say=None) -> dict[str, float]:
    """Compile (or load from the cache) every kernel for the argument types the package uses;
    seconds per module (``say(name, seconds)`` as each is done). Stamps the cache as complete
    for ``prepare``.

    Processes warming up together on an empty cache (a test session's two pytest processes,
    launches started side by side) share the work instead of each compiling everything: a
    module is compiled or loaded under its lock in the cache, and a process takes first the
    modules no other holds, then loads the rest from the cache once their holder is done. On
    2 cores: 41 s (select_kernels' compile) instead of 74 s (all three, in both processes)."""
    # the longest compile first
    pending = [importlib.import_module(KERNEL_MODULES[name])
               for name in ("select_kernels", "agg_kernels", "codec_kernels", "value_kernels")]
    times = {}
    while pending:
        module, lock = _take_module(pending)
        try:
            t = time.perf_counter()
            module.warm_up()
            name = _module_name(module)
            times[name] = time.perf_counter() - t
        finally:
            if lock is not None:
                lock.close()  # (closing the file releases its lock)
        pending.remove(module)
        if say is not None:
            say(name, times[name])
    try:
        _stamp_path().write_text(_stamp())
    except OSError:
        pass  # an unwritable cache: numba caches nothing either
    return times


def _take_module(pending: list):
    """(module, its locked lock file) for the next module to warm up: the first that no other
    process is warming up, else the first whose holder is done. (module, None) where
    nothing is cached or the cache has no room for lock files: then each process warms up on
    its own."""
    import fcntl

    from . import numba_jit
    if not numba_jit.CACHING:  # nothing is shared: each process compiles for itself
        return pending[0], None
    try:
        Path(cache_dir()).mkdir(parents=True, exist_ok=True)
        while True:  # (polled, not waited on: whichever module is freed first is taken)
            for module in pending:
                lock = open(_lock_path(module), "w")
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return module, lock
                except BlockingIOError:
                    lock.close()  # another process is warming it up: try the next
            time.sleep(0.05)
    except OSError:
        return pending[0], None


def _lock_path(module) -> Path:
    return Path(cache_dir()) / f"psparse-{_module_name(module)}.lock"


def _module_name(module) -> str:
    return module.__name__.rsplit(".", 1)[1]  # psparse.ops.aggregate.agg_kernels -> agg_kernels


def _stamp_path() -> Path:
    return Path(cache_dir()) / "psparse-kernels.stamp"


def _stamp() -> str:
    """What a complete cache was compiled by and from: numba's version, the CPU (numba keys
    its entries by both) and the kernel sources' sizes and times (its key for a source)."""
    import numba
    from llvmlite import binding
    root = Path(__file__).resolve().parents[2]  # the folder psparse/ is in
    files = [root / (module.replace(".", "/") + ".py")
             for module in (*KERNEL_MODULES.values(), __name__.rsplit(".", 1)[0] + ".numba_jit")]
    return "\n".join([numba.__version__, binding.get_host_cpu_name()]
                     + [f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files])


def preload(modules: tuple[str, ...], entries: int, say=None) -> float | None:
    """Before a process's first round: load (or compile) the kernels it will run, so that
    round 1 does not pay for them (on a host with a sixth of a core, ~2.6 s), and say how
    long it took. Only in a process started alone (a ``--hostfile``, ``--slurm`` or torchrun
    worker, a ``psparse-server``): children forked by ``psparse-launch`` have numba from the
    launcher already and load a kernel in ~5 ms as they first run it. Nothing for a run whose
    calls stay below ``SMALL`` entries (they run the numpy references: no numba at all) or
    with ``PSPARSE_CPU_KERNELS=numpy``. Seconds taken, or None when nothing was loaded.
    ``modules``: kernel modules by short name (``select_kernels``, ``agg_kernels``,
    ``codec_kernels``)."""
    if REFERENCE or entries < SMALL or "numba" in sys.modules:
        return None
    t = time.perf_counter()
    if say is not None:  # before: where numba's cache lacks them this can take minutes
        say(f"loading CPU kernels ({', '.join(modules)}), compiling those numba's cache lacks "
            "(the first run on a host: minutes on a slow one; the server waits "
            "--register-timeout)")
    for name in modules:
        importlib.import_module(KERNEL_MODULES[name]).warm_up()
    seconds = time.perf_counter() - t
    if say is not None:
        say(f"CPU kernels ({', '.join(modules)}) loaded in {seconds:.2f} s, before the first "
            "round")
    return seconds


def prepare() -> None:
    """Before forking: compile every kernel unless the cache's stamp says it holds them all,
    else start numba only; each child then loads what it runs (the module docstring)."""
    if REFERENCE:
        return
    from .aggregate import agg_kernels
    try:
        cached = _stamp_path().read_text() == _stamp()
    except OSError:
        cached = False
    if cached:
        agg_kernels.divide(np.ones(1, np.float32), 1, np.float32(1))  # numba's initialisation
    else:
        warm_up()


def main(argv=None) -> int:
    """``python -m psparse.ops.jit``: compile or load every kernel; print where and how long."""
    import numba
    print(f"numba {numba.__version__}, cache {cache_dir()}", flush=True)
    t = time.perf_counter()
    warm_up(say=lambda name, seconds: print(f"  {name}: {seconds:.2f} s", flush=True))
    print(f"  all kernels: {time.perf_counter() - t:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
