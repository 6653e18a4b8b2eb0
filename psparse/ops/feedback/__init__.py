"""Error feedback and the policies' decayed state: accumulate a gradient, take the pushed
entries out, decay and add a policy's per-entry state.

Callers use it through ``psparse/policies/memory.py`` (``Memory``, one rule per ``--memory``).
``updates.py`` is the numpy reference (written against ``xp``; its numba kernels are in
../select/select_kernels.py, beside the selection they share a pass with) and
``elementwise.cu`` the device's kernels (also the aggregate's scatter and the output checks),
held to it on the emulated device by tests/test_kernels.py and tests/test_kernel_emu.py.
"""
