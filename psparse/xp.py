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

# The GPU machines run CUDA 13; the matching CuPy wheel (also `pip install -e '.[gpu]'`).
CUPY_HINT = "pip install cupy-cuda13x"
INDEX_DTYPE = np.int64  # the one index dtype the kernels take (CUDA C: long long)


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
        raise RuntimeError(f"a CUDA tensor needs CuPy for the GPU path ({CUPY_HINT})")
    return cupy.from_dlpack(tensor.detach())


def to_device(xp, *arrays):
    """Received host arrays (a decoded message) moved to ``xp``'s device, as the kernels want them.

    This is the one boundary where the protocol's data meets the kernels: the protocol decodes
    indices as int32 or int64 depending on the index format (raw int32 frames stay int32 views),
    so integer arrays become ``INDEX_DTYPE`` here, once, instead of in every kernel. Float arrays
    keep their dtype; host arrays already in int64 are not copied.
    """
    out = []
    for a in arrays:
        if a is not None and a.dtype.kind in "iu":
            a = a.astype(INDEX_DTYPE, copy=False)
        out.append(a if xp is np or a is None else xp.asarray(a))
    return tuple(out)


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

