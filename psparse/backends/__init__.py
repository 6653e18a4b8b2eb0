"""Where a worker's (and a GPU server's) steps run: one small protocol, three implementations.

A policy or an error-feedback ``Memory`` holds one backend and writes each step once against it
(selection engines, accumulate/take, decayed state vectors, uploads and reads); the backend
supplies the implementation from psparse/ops/:

* ``host.py``: the host, numpy and the numba kernels (``HostBackend``, ``HostEngines``);
* ``cuda.py``: CUDA through CuPy, the one door between device and host memory
  (``CudaBackend``; ``Backend`` is the base both device backends share);
  ``device_engines.py``: the radix engine's selections and the lazily decayed state it offers
  a policy;
* ``emulated.py``: the strict emulated device (the CUDA C on the CPU, every implicit read to
  the host refused), for tests and ``make gpu-check-cpu``; ``kernel_emu.py`` compiles the CUDA
  C for the CPU;
* ``devices.py``: which one a process gets; ``kernel_check.py``: the NVRTC gate (``make
  check-kernels``).

docs/gpu.md describes the device path; docs/architecture.md, "The GPU exchange", its place in a
round.
"""
