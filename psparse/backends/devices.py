"""Which backend a process gets: CUDA through CuPy, the strict emulated device, or none (the host).

Which backend a worker or a server gets: CUDA through CuPy on a CUDA device, the strict
emulated device when ``PSPARSE_EMULATE_GPU`` asks for it (tests, ``make gpu-check-cpu``), or none
(the host path). Kept apart from both backends so that each imports only what it runs on."""

from __future__ import annotations

import os

from ..xp import CUPY_HINT, cupy_or_none
from .cuda import CudaBackend


def device_backend(device, log=print):
    """The backend for a worker on ``device`` (a torch.device): the emulated one when
    ``PSPARSE_EMULATE_GPU`` asks for it, CUDA with CuPy on a CUDA device, else None (the host
    path; on a CUDA device without CuPy the gradient crosses to the host once per round)."""
    emulated = emulated_from_env()
    if emulated is not None:
        return emulated
    if device.type != "cuda":
        return None
    if os.environ.get("PSPARSE_GPU_PATH") == "host":  # the fallback, for comparisons
        log("PSPARSE_GPU_PATH=host: selection runs on the host (one gradient copy per "
            "iteration)")
        return None
    cupy = cupy_or_none()
    if cupy is None:
        log("CuPy not found: selection runs on the host (one gradient copy per iteration; "
            f"{CUPY_HINT} for the GPU kernels)")
        return None
    cupy.cuda.Device(device.index or 0).use()
    return CudaBackend(cupy, device.index or 0)


def emulated_from_env():
    """The backend ``PSPARSE_EMULATE_GPU`` asks for (strict / 1), or None."""
    mode = os.environ.get("PSPARSE_EMULATE_GPU", "")
    if mode in ("", "0"):
        return None
    from .emulated import EmulatedBackend
    return EmulatedBackend(strict=mode == "strict")
