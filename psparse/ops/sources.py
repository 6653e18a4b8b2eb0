"""The CUDA C the GPU path launches, and the check every launch passes.

Three sources, each a ``.cu`` file in its operation's folder, so that the whole of what the package
can launch is their text: ``feedback/elementwise.cu``, the element kernels (error feedback,
gather-and-zero, the aggregate's scatter, the output checks, the decayed state with its scale on the
device); ``select/radix.cu``, the selection engine's (``select/radix.py``; the layout of the tables
its kernels read is documented there); and ``values/values.cu``, a push's values rounded to the
run's format. CuPy compiles each once per process (and caches it on disk); ``make check-kernels``
compiles them with NVRTC on machines without a GPU (``psparse/backends/kernel_check.py``);
``psparse/backends/kernel_emu.py`` runs them on the CPU for the tests. They are plain ``__global__``
functions rather than ElementwiseKernels for that reason. Indices the kernels take are int64 (long
long): received int32 indices are widened once, as they are uploaded. Most are grid-stride loops
over n elements (a backend's ``launch_over``); the decayed state's decisions run on one thread.
Float maths uses the _rn intrinsics so the compiler cannot fuse a multiply and an add (numpy rounds
after each), so GPU policy state is bit-identical to the host's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_OPS = Path(__file__).resolve().parent
CUDA_SOURCE = (_OPS / "feedback" / "elementwise.cu").read_text()
RADIX_SOURCE = (_OPS / "select" / "radix.cu").read_text()
VALUES_SOURCE = (_OPS / "values" / "values.cu").read_text()


# C parameter type -> (array or scalar, dtype) that a launch must pass for it
C_TYPES = {
    "const float*": ("array", np.float32), "float*": ("array", np.float32),
    "const long long*": ("array", np.int64), "long long*": ("array", np.int64),
    "unsigned long long*": ("array", np.uint64), "const unsigned long long*": ("array", np.uint64),
    "unsigned int*": ("array", np.uint32), "const unsigned char*": ("array", np.uint8),
    "unsigned char*": ("array", np.uint8), "int*": ("array", np.int32),
    "signed char*": ("array", np.int8), "const signed char*": ("array", np.int8),
    "unsigned short*": ("array", np.uint16),
    "const int*": ("array", np.int32), "double": ("scalar", np.float64),
    "double*": ("array", np.float64), "const double*": ("array", np.float64),
    "long long": ("scalar", np.int64), "float": ("scalar", np.float32), "int": ("scalar", np.int32),
}
_KERNEL_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')


def kernel_signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    """{kernel name: [(C type, parameter name), ...]} of every kernel in a CUDA C source."""
    signatures = {}
    for name, params in _KERNEL_SIGNATURE.findall(source):
        pairs = []
        for param in params.split(","):
            ctype, _, pname = " ".join(param.split()).replace(" *", "* ").rpartition(" ")
            pairs.append((ctype.strip(), pname))
        signatures[name] = pairs
    return signatures


CUDA_KERNELS = kernel_signatures(CUDA_SOURCE)


def check_launch(name: str, args: tuple, signature: list[tuple[str, str]]) -> None:
    """Arguments against the kernel's C signature: a launch with a wrong count, dtype or a
    non-contiguous array would read memory as the wrong type; this makes it a clear error."""
    if len(args) != len(signature):
        raise TypeError(f"{name}: {len(args)} arguments for {len(signature)} parameters "
                        f"({', '.join(p for _, p in signature)})")
    for arg, (ctype, pname) in zip(args, signature):
        kind, dtype = C_TYPES[ctype]
        is_array = hasattr(arg, "shape") and not isinstance(arg, np.generic)
        if kind == "array" and not (is_array and arg.dtype == dtype and arg.flags.c_contiguous):
            got = f"{arg.dtype} array" + ("" if arg.flags.c_contiguous else ", not contiguous") \
                if is_array else type(arg).__name__
            raise TypeError(f"{name}: {pname} must be a contiguous {np.dtype(dtype)} array "
                            f"({ctype}), got {got}")
        if kind == "scalar" and not (isinstance(arg, np.generic) and arg.dtype == dtype):
            raise TypeError(f"{name}: {pname} must be a numpy {np.dtype(dtype)} scalar ({ctype}), "
                            f"got {type(arg).__name__}")


def build_cupy_kernels(cupy, source: str = CUDA_SOURCE, names=tuple(CUDA_KERNELS)) -> dict:
    """CuPy kernel objects for ``names`` in ``source``; constructing one compiles nothing (the
    first launch does, and CuPy caches the binary on disk by source, so all four share it)."""
    return {name: cupy.RawKernel(source, name) for name in names}
