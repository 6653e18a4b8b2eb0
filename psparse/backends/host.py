"""The host as a backend: the operations a policy and the error-feedback memory ask of a device,
done on the host with numpy and the numba kernels (``psparse.ops``).

A policy or a ``Memory`` holds one backend, the host's (this module) or a device's
(``psparse.backends.cuda``: CUDA, or the strict emulator), and writes each step once against it:

* ``upload(name, array)`` / ``read(array)``: host arrays onto the backend and back (the host:
  the array itself);
* ``accumulate(mode, ...)``, ``take(acc, indices, velocity)``, ``clipped(grad, norm)``: error
  feedback's steps (``Memory``);
* ``decaying(n)``: a policy's lazily decayed state (``updates.Decaying``; on a device
  ``DeviceDecaying``, its scale and renormalisations decided there);
* ``engines(layout)``: the selection engines, whose ``select(name, key, ks, fusion, ...)``
  ranks a ``radix.Key`` (what the policy scores) in every slice of the layout and ``topk``
  one score array. On the host an engine is a ``Selector`` per slice (numba, or numpy where
  the compiled kernels are off); on a device the radix engine (``device_policy``). The host
  returns sorted int64 indices; the device a ``DeviceSelection`` (indices, values taken or
  read, counts) that the round copies back.

* ``index_set(n)``: the indices of the last aggregate, kept for the next round (sorted on the
  host, a byte mask on a device).

The keys the host engines rank are those the built-in policies' one path states: |x|
(``KEY_ABS``) and |x| >= lam, the share's largest if more (``KEY_THRESHOLD``); the scored
policies (ema, penalty, core, frequency) rank on the host through their own host selection
(``score`` / ``select_slice``: compiled scores or their numpy references), written beside the
device key.
"""

from __future__ import annotations

import numpy as np

from ..ops.feedback import updates
from ..ops.jit import host_compiled
from ..ops.select import radix, selection, sparsify
from ..ops.select.sparsify import Selector, select_kernels
from ..xp import to_host


class HostEngines:
    """The host's selection engines for one layout: a ``Selector`` per slice (its scratch)."""

    def __init__(self, layout):
        self.layout = layout
        self.selectors = [Selector(size) for _, size in layout.slices]
        self._scratch = np.empty(min(sparsify.BLOCK, max(1, layout.numel)), np.float32)
        self.layers = None  # (first, end): the device's bucket restriction; the host's parts
        #                     select through the policy's per-slice path

    ranks_every_key = False  # only KEY_ABS and KEY_THRESHOLD (module docstring)

    def topk(self, score, k: int, offset: int = 0) -> np.ndarray:
        """Sorted indices (relative) of the k largest |score| in the slice at ``offset``."""
        return self.selectors[self.layout.slice_index(offset)].topk(score, k)

    def at_least(self, x, lam: float) -> np.ndarray:
        """Sorted indices of |x| >= lam in one array (block by block: no |x| or mask of its
        size), the compiled kernel where it takes the array, else its numpy oracle."""
        if host_compiled(x):  # 64 entries per vector compare
            return select_kernels.at_least(x, np.float32(lam))
        return selection.at_least(x, lam, self._scratch)

    def largest(self, values, count: int) -> np.ndarray:
        """Sorted positions of the ``count`` largest |values| of one array (ties to the lower
        position)."""
        return self.selectors[0].topk(values, count) if len(self.selectors) == 1 and \
            values.size <= self.layout.numel else Selector(values.size).topk(values, count)

    def select(self, name: str, key: radix.Key, ks, fusion=None, *, final: bool = True,
               exclude_zero: bool = False, values=True, segments=None) -> np.ndarray:
        """The ks largest keys per slice, as sorted global indices (``DeviceEngines.select``'s
        answer on the host; ``exclude_zero``: without entries whose key is 0). The device's
        answer is a ``DeviceSelection`` that may carry the values (``final``, ``values``); on
        the host the round takes them, so those two arguments change nothing here."""
        if segments is not None:
            raise ValueError("the host engines select over the layout's slices")
        if key.mode == radix.KEY_ABS:
            chosen = self._per_slice(key.x, ks, self.topk)
            return chosen[key.x[chosen] != 0] if exclude_zero else chosen
        if key.mode == radix.KEY_THRESHOLD:
            return self._at_least(key.x, key.p0, ks)
        raise ValueError(f"the host engines have no ranking for key mode {key.mode} (the "
                         "policy ranks it on the host itself)")

    def _per_slice(self, x, ks, choose) -> np.ndarray:
        parts = [choose(x[o:o + n], k, o) + o
                 for (o, n), k in zip(self.layout.slices, ks) if k > 0]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _at_least(self, acc, lam: float, shares) -> np.ndarray:
        """|acc| >= lam, block by block (no model-sized |acc| or mask); per slice, the share's
        largest when more pass (the rest waits in the accumulator)."""
        chosen = self.at_least(acc, lam)
        bounds = selection.slice_bounds(chosen, self.layout.slices)
        if all(hi - lo <= share for (lo, hi), share in zip(bounds, shares)):
            return chosen
        parts = []
        for (lo, hi), (offset, size), share in zip(bounds, self.layout.slices, shares):
            if hi - lo <= share:
                parts.append(chosen[lo:hi])
            elif share > 0:
                parts.append(self.topk(acc[offset:offset + size], share, offset) + offset)
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


class HostIndexSet:
    """A set of indices the group shares (the last aggregate's), as the host ranks with it:
    sorted, and looked up slice by slice (``within``). The device's (``DeviceIndexSet``) is a
    byte mask the radix engine reads."""

    mask = None  # the host engines take no mask

    def __init__(self, xp=np):
        self.xp = xp
        self.indices = xp.empty(0, dtype=xp.int64)  # sorted
        self._host = np.empty(0, dtype=np.int64)  # the same, for searchsorted

    def replace(self, indices) -> None:
        """The set becomes these (sorted, distinct) indices."""
        self._host = np.array(to_host(indices), dtype=np.int64)
        self.indices = self.xp.asarray(self._host)

    def within(self, offset: int, size: int):
        """The set's entries in [offset, offset + size), relative to offset."""
        lo, hi = (int(i) for i in np.searchsorted(self._host, [offset, offset + size]))
        return self.indices[lo:hi] - offset


class HostBackend:
    """The host's answers to what a policy and a memory ask of a backend (module docstring)."""

    name = "host"

    def __init__(self, xp=np):
        self.xp = xp

    def upload(self, name: str, host, out=None):
        """The array itself (into ``out`` if given): host memory is where it already is."""
        if out is None:
            return host
        out[...] = host
        return out

    def read(self, array) -> np.ndarray:
        return to_host(array)

    def engines(self, layout) -> HostEngines:
        return HostEngines(layout)

    def decaying(self, n: int, bounds=None) -> updates.Decaying:
        """A lazily decayed vector of policy state (value = scale * stored); with ``bounds``
        (slice edges) it can track each slice's largest stored value, as the device's does."""
        return updates.Decaying(n, self.xp, bounds)

    def index_set(self, n: int) -> HostIndexSet:
        """The indices of one aggregate, kept until the next (penalty's shared entries)."""
        return HostIndexSet(self.xp)

    # -------------------------------------------------------------------- error feedback
    def accumulate(self, mode: int, acc, grad, velocity, filtered, momentum: float):
        """Fold a (prepared) gradient into the accumulator: acc += g; DGC's velocity first;
        ScaleCom's p_t = m_t + g_t (``Memory.accumulate_spec`` names the mode)."""
        if mode == radix.ACC_FILTERED:
            return self.xp.add(filtered, grad, out=acc)
        return updates.accumulate(acc, grad, velocity if mode == radix.ACC_DGC else None,
                                  momentum)

    def take(self, acc, indices, velocity):
        """acc's values at ``indices``, then zero them there (and the velocity)."""
        return updates.take(acc, indices, velocity)

    def clipped(self, grad, clip_norm: float):
        """The gradient scaled to L2 norm <= clip_norm (the norm compared in Python)."""
        norm = float(self.xp.linalg.norm(grad))
        return grad * np.float32(clip_norm / norm) if norm > clip_norm else grad
