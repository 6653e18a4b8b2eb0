"""The array-module layer: the same maths on numpy (host) or CuPy (GPU), chosen by where data lives.

Selection, error feedback and policy state are written once against ``xp``, the module of the
arrays they are given (``xp = array_module(acc)``): numpy arrays get numpy, CuPy arrays get
CuPy. torch tensors cross without copies: a CPU tensor's ``.numpy()`` shares its memory, and a
CUDA tensor becomes a CuPy array through DLPack (same device memory, same stream semantics).

CuPy is imported lazily and only when a CUDA tensor or ``--device cuda`` asks for it, so
everything imports and runs on machines without it.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=1)
def cupy_or_none():
    """The cupy module when it imports and sees a CUDA device, else None (never raises)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, or CUDA libraries/driver missing: CPU only
        return None


def array_module(a):
    """numpy or cupy, whichever owns ``a`` (anything that is not a CuPy array is host data)."""
    if type(a).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def is_gpu(a) -> bool:
    return array_module(a) is not np


def from_torch(tensor):
    """A numpy (CPU tensor) or CuPy (CUDA tensor) array sharing the tensor's memory."""
    if tensor.device.type == "cpu":
        return tensor.detach().numpy()
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError("a CUDA tensor needs CuPy for the GPU path (pip install cupy-cuda12x)")
    return cupy.from_dlpack(tensor.detach())


def to_torch(a):
    """A torch tensor sharing the memory of a numpy or CuPy array."""
    import torch
    if is_gpu(a):
        return torch.from_dlpack(a)
    return torch.from_numpy(np.asarray(a))


def to_host(a, out: np.ndarray | None = None) -> np.ndarray:
    """A numpy array with the values of ``a`` (into ``out``, e.g. a pinned buffer, if given)."""
    if not is_gpu(a):
        if out is None:
            return a
        out[...] = a
        return out
    if out is None:
        return a.get()
    a.get(out=out)
    return out

