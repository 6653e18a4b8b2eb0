"""Error feedback's two steps (accumulate, take) and the policies' decayed state, in numpy (xp).

=====================  ==================================  ===================================
step                   numpy (host, the reference)         CUDA (psparse/ops/feedback/elementwise.cu)
=====================  ==================================  ===================================
DGC accumulate         v *= m; v += g; acc += v            one fused pass (or fused into the
                                                           selection's first pass: radix)
take                   acc[idx] (copy); acc[idx] = 0        one gather-and-zero (or fused into
                                                           the selection's last pass)
EMA / count update     lazy: scale *= beta on the host,     the same, the scale a device double
(``Decaying``)         one numpy.add.at over k entries      (``gpu/device_policy.DeviceDecaying``)
=====================  ==================================  ===================================

The CUDA kernels avoid fused multiply-add where numpy rounds twice, so GPU policy state is
bit-identical to the host's. ``Decaying``'s compiled scatter is ``select_kernels.scatter_add``.
"""

from __future__ import annotations

import numpy as np

from .. import jit
from ..select import selection
from ..select.selection import select_kernels

SCATTER_CHUNK = 1 << 14  # entries read, added and written back at a time (their lines stay in L2)


def accumulate(acc, grad, velocity=None, momentum: float = 0.0):
    """acc += grad; or DGC momentum correction: velocity = m * velocity + grad; acc += velocity.

    In place; returns acc.
    """
    if velocity is None:
        acc += grad
    else:
        velocity *= np.float32(momentum)
        velocity += grad
        acc += velocity
    return acc


def take(acc, indices, velocity=None):
    """The values of acc at ``indices`` (a copy), then zero acc (and velocity) there."""
    values = acc[indices]
    acc[indices] = 0.0
    if velocity is not None:
        velocity[indices] = 0.0
    return values


# -------------------------------------------------------------------------- policy state
def decay_and_add(priority, indices, values, decay: float, weight: float,
                  magnitude: bool = True, out=None):
    """priority *= decay; priority[indices] += weight * (|values| or values).

    ``out`` (optional, indices.size floats) receives the updated values at ``indices``.
    (The built-in policies keep their state in a ``Decaying`` vector, which decays lazily.)
    """
    priority *= np.float32(decay)
    scatter_add(priority, indices, values, weight, magnitude, out)
    return priority


def decay_and_count(priority, indices, decay: float):
    """priority *= decay; priority[indices] += 1 (frequency counts)."""
    priority *= np.float32(decay)
    scatter_add(priority, indices, None, 1.0)
    return priority


def scatter_add(target, indices, values, weight: float, magnitude: bool = True,
                out=None) -> None:
    """target[indices] += weight * (|values| or values); ``values`` None: += weight. ``out``
    (optional, indices.size floats) receives the updated values.

    The aggregate's indices are distinct, so the scatter needs no atomics (on the host,
    ``numpy.add.at``'s fast path: 1.5-2x faster than ``target[indices] += ...``, the same
    sums). With
    ``out`` the host reads, adds and writes back SCATTER_CHUNK entries at a time, so each
    entry's cache line is fetched once (add.at and then a gather fetched it twice: a model-sized
    target is not in cache, and the aggregate touches a line per entry).
    """
    if not indices.size:
        return
    add = np.float32(weight) if values is None else \
        np.float32(weight) * (np.abs(values) if magnitude else values)
    if out is None:
        np.add.at(target, indices, add)
        return
    for start in range(0, indices.size, SCATTER_CHUNK):
        part = slice(start, start + SCATTER_CHUNK)
        # mode="clip": the indices are in range, and the default "raise" buffers ``out``
        updated = np.take(target, indices[part], out=out[part], mode="clip")
        updated += add if values is None else add[part]
        target[indices[part]] = updated


class Decaying:
    """A float32 vector that decays by a factor every round and grows at the aggregate's
    indices (the EMA and count state of ``core``, ``ema`` and ``frequency``), kept lazily as

        value = scale * stored     (scale: a host float, the product of the decays so far)

    so a round costs O(aggregate), not a pass over the model: ``decay`` multiplies ``scale``,
    ``add`` scatters weight / scale. Rankings by value are rankings by ``stored`` (one positive
    factor), which is what the policies read. Renormalising (stored *= scale, scale = 1) once
    scale falls below RENORMALISE_BELOW keeps ``stored`` in range (at most 2^64 times the
    largest value added) and flushes every value below float32's smallest normal to zero.

    Against decaying every entry every round (``decay_and_add``): the same values up to float
    rounding (each is rounded once per add, not once per round; for a power-of-two decay, e.g.
    core's beta = 0.5, bit-identical while values are normal), and values that decayed below
    1.2e-38 are 0 from the next renormalisation on, where the eager update kept subnormals (each
    ~30 ns to multiply, on x86) until they underflowed. Deterministic and built from the
    aggregate alone: identical on every worker. ``state_dict`` holds ``stored`` and ``scale``,
    so a restored vector continues bit-identically.
    """

    RENORMALISE_BELOW = 2.0 ** -64

    def __init__(self, n: int, xp=np, bounds=None):
        self.xp = xp
        self.stored = xp.zeros(n, dtype=xp.float32)
        self.scale = 1.0
        # with ``bounds`` (slice edges [0, ..., n]): each slice's largest stored value, ``top``,
        # kept by the calls that say track_max (ema's score reads it), as the device's is
        edges = list(bounds) if bounds is not None else [0, n]
        self.slices = [(lo, hi - lo) for lo, hi in zip(edges[:-1], edges[1:])]
        self.top = np.zeros(max(1, len(self.slices)), np.float32)

    def decay(self, factor: float, track_max: bool = False) -> bool:
        """value *= factor. Returns True when ``stored`` was renormalised (rescaled), and then
        recomputes the maxima with ``track_max``."""
        self.scale *= factor
        if self.scale >= self.RENORMALISE_BELOW:
            return False
        self.renormalise()
        if track_max:
            self.refresh_maxima()
        return True

    def refresh_maxima(self) -> None:
        """top = each slice's largest stored value (after a restore or a rescale)."""
        stored = self.stored
        self.top = np.array([float(stored[o:o + n].max()) if n else 0.0
                             for o, n in self.slices], np.float32)

    def renormalise_above(self, limit: float) -> None:
        """ema's rule: renormalise when the largest tracked value passes ``limit`` while the
        scale is below 1 (the score multiplies |acc| by about max(stored): kept far from
        float32's range), then the maxima again."""
        if float(self.top.max()) > limit and self.scale < 1:
            self.renormalise()
            self.refresh_maxima()

    def renormalise(self) -> None:
        """stored *= scale, scale = 1 (the same values); what falls below float32's smallest
        normal becomes 0. A pass over the vector."""
        stored = self.stored
        if jit.host_compiled(stored):  # one compiled pass
            select_kernels.renormalise(stored, np.float32(self.scale))
        else:
            stored *= np.float32(self.scale)
            stored[self.xp.abs(stored) < np.finfo(np.float32).tiny] = 0.0
        self.scale = 1.0

    def add(self, indices, values, weight: float, magnitude: bool = True, out=None,
            track_max: bool = False) -> None:
        """value[indices] += weight * (|values| or values); ``values`` None: += weight.
        ``out`` (optional, indices.size floats) receives the updated stored values;
        ``track_max``: each slice's ``top`` rises to its largest updated value. numpy
        (``scatter_add``): ``add_compiled``, measured back to back in ema's and frequency's
        observe at 11M, was faster at 1% (6.4 against 6.8 ms) but slower at 0.1% (1.46 against
        1.10, 1.04 against 0.85); core, faster at both, calls ``add_compiled`` itself."""
        if track_max and out is None:
            out = self.xp.empty(indices.size, dtype=self.xp.float32)
        scatter_add(self.stored, indices, values, weight / self.scale, magnitude, out)
        if track_max:
            for s, (lo, hi) in enumerate(selection.slice_bounds(indices, self.slices)):
                if hi > lo:
                    self.top[s] = max(self.top[s], np.float32(float(out[lo:hi].max())))

    def add_compiled(self, indices, values, weight: float, magnitude: bool = True, out=None,
                     old=None, tops=None, edges=None) -> None:
        """``add`` on the host, compiled (``select_kernels.scatter_add``: the same sums); also
        the stored values before the add into ``old`` and, per slice [edges[s], edges[s+1]),
        the largest updated value into ``tops[s]`` (kept if larger), when given."""
        n = indices.size
        out = np.empty(n, np.float32) if out is None else out
        old = np.empty(n, np.float32) if old is None else old
        mode = 2 if values is None else 0 if magnitude else 1
        values = select_kernels.NO_AUX if values is None else np.ascontiguousarray(values)
        select_kernels.scatter_add(
            self.stored, np.ascontiguousarray(indices), values, np.float32(weight / self.scale),
            mode, old, out, select_kernels.NO_MARKS if edges is None else edges,
            select_kernels.NO_AUX if tops is None else tops)

    def values(self):
        """The values themselves (a new array; for inspection and tests)."""
        return self.stored * np.float32(self.scale)

    def state_dict(self) -> dict:
        return {"priority": self.stored, "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """A ``state_dict``; or, from a checkpoint of the eager update, the values alone."""
        self.stored[...] = self.xp.asarray(state["priority"])
        self.scale = float(state.get("scale", 1.0))
