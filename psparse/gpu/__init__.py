"""The GPU path: CUDA C, the radix-select engine, the backends it runs on, and its test doubles.

* ``elementwise.cu`` and ``radix.cu``, read by ``sources.py`` (with every launch's check);
  ``radix.py``: selection with no host round trip;
* ``backend.py``: CUDA through CuPy, the one door between device and host memory;
  ``emulated.py``: the strict emulated device (the CUDA C on the CPU, every implicit read to
  the host refused); ``devices.py``: which one a process gets;
* ``kernel_emu.py``: the CUDA C compiled for the CPU (tests); ``kernel_check.py``: the NVRTC
  gate (``make check-kernels``);
* ``device_policy.py``, ``device_aggregation.py``: what a policy and the server use on the device.

docs/gpu.md describes the path; docs/architecture.md, "The GPU exchange", its place in a round.
"""
