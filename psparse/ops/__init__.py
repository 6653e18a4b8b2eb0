"""The hot steps, one folder per operation, each with its implementations side by side.

Every operation has one numpy reference (the test oracle, and the path for calls too small or
arrays too odd for a kernel), one numba kernel for the CPU and, where the GPU runs it, CUDA C,
held bit-identical to the reference by the tests named in each folder's docstring:

===========  ==========================  ==============  =================  ==================
folder       what callers import         numpy           numba (CPU)        CUDA C (GPU)
===========  ==========================  ==============  =================  ==================
select/      ``sparsify`` (top-k),       ``selection``   ``select_kernels`` ``radix.cu`` driven
             ``radix`` (device engine)                                      by ``radix.py``
aggregate/   server/aggregation.py       ``reference``   ``agg_kernels``    ``device_aggregation``
codec/       ``codec`` (index frames)    ``reference``   ``codec_kernels``  --
values/      ``formats`` (``--values``)  ``quantize``    ``value_kernels``  ``values.cu``
feedback/    policies/memory.py          ``updates``     in select_kernels  ``elementwise.cu``
===========  ==========================  ==============  =================  ==================

Beside them, how the kernels are built and loaded: ``jit.py`` (numba kernel modules loaded on
first use, ``warm_up``/``prepare``, the small-call rule, ``PSPARSE_CPU_KERNELS=numpy``),
``numba_jit.py`` (numba's configuration and the LLVM-IR vector compares the kernels use),
``cache.py`` (where numba's cache lives) and ``sources.py`` (the CUDA C text and the check every
launch passes). Which implementation a worker runs is its backend's choice (psparse/backends/).

Nothing here knows of sockets, messages, options or models (docs/architecture.md).
"""
