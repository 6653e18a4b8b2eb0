"""Index coding and the protocol's frame checks: the delta (varint) and bitmap forms of a sorted
index set, and the checks a received sparse frame passes.

``codec.py`` is what callers use (``encode``/``decode``, ``KeyCache``, ``CodecError``);
``reference.py`` is the numpy reference and ``codec_kernels.py`` the numba kernels, bit-identical
(tests/test_cpu_kernels.py). docs/protocol.md, "Index frames", is the format.
"""
