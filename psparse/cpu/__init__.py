"""The CPU kernels: numba-compiled hot steps, their loader and cache, and their numpy references.

* ``jit.py``: kernel modules loaded on first use, ``warm_up``/``prepare``, the small-call rule,
  ``PSPARSE_CPU_KERNELS=numpy``; ``cache.py``: where numba's cache lives; ``numba_jit.py``:
  numba's configuration and the LLVM-IR vector compares the kernels use;
* ``select_kernels.py``, ``agg_kernels.py``, ``codec_kernels.py``: the kernels (the worker's
  selection and policy state, the server's sums, the index coding and frame checks);
* their numpy references, the kernels' test oracle and the path for arrays the kernels do not
  take: ``reference.py`` (the server's and the codec's), ``selection.py`` (top-k, index sets),
  ``updates.py`` (error feedback, decayed state), ``sparsify.py`` (top-k, dispatching to the
  kernels or the references).

Nothing here knows of sockets, messages or models (docs/architecture.md, "Compiled CPU kernels").
"""
