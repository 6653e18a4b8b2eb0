"""The CUDA C of the device selection engine (``psparse.radix``): radix select, no host round trip.

The source is ``psparse/radix.cu``, kept apart from the orchestration so that the whole of what
the engine can launch is that one text: `make check-kernels` compiles it with NVRTC, and
``psparse.kernel_emu`` runs it on the CPU for the tests. Layout of the tables the kernels read is
documented in ``psparse/radix.py``.
"""

from pathlib import Path

RADIX_SOURCE = (Path(__file__).with_name("radix.cu")).read_text()
