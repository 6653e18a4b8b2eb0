"""The server's round arithmetic: the rank-order sum and mean at the union, the size limit's
merge, the vote's candidates, the shards' split and merge.

Callers use it through ``psparse/server/aggregation.py`` (``Aggregator``, ``ServerLimit``).
``reference.py`` is the numpy reference, ``agg_kernels.py`` the numba kernels (bit-identical,
tests/test_cpu_kernels.py), ``device_aggregation.py`` the sum on a GPU (``--server-device
cuda``; the scatter kernel of ../feedback/elementwise.cu and the radix engine of ../select/;
tests/test_device_aggregation.py).
"""
