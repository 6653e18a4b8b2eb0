"""Value formats (``--values``): float32 values to bf16, fp16, int8 or int4 codes and back.

``formats.py`` is what callers use (``ValueFormat``, ``FORMATS``, ``unpack``); ``quantize.py``
is the numpy reference (written against ``xp``), ``value_kernels.py`` the numba kernels and
``values.cu`` the device's rounding with its error fed back, all bit-identical
(tests/test_values.py, tests/test_device_values.py). docs/protocol.md, "Value formats", is the
format.
"""
