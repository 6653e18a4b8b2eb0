"""Selection: the k entries of largest score (|accumulator|, or a policy's score), ties to the
lower index, sorted.

* ``sparsify.py``: what callers use -- ``topk_exact`` (small tensors), ``Selector`` (sampled
  threshold, compaction, trim to exactly k), ``density_to_k``, ``split_k``;
* ``selection.py``: the numpy reference (sampled threshold, blockwise compaction, exact
  top-k) and the index-set helpers the rounds share;
* ``select_kernels.py``: the numba kernels (top-k, the policies' block scores and state, and
  error feedback's scatter-add), held to the reference by tests/test_select_kernels.py;
* ``radix.py`` and ``radix.cu``: the device's radix select, no host round trip
  (``keys_reference``/``plan_reference`` are its numpy reference; tests/test_radix.py).
"""
