"""What a selection policy uses on the device: the engine's selections and lazily decayed state.

On the GPU (``--device cuda``) a policy's ``select`` runs the radix engine
(``psparse.ops.select.radix``) instead of the host's partitions: ``DeviceEngines.select`` ranks a
``radix.Key`` (the policy's score, made on the fly in every pass: no model-sized temporary) in every
slice at once and returns a ``DeviceSelection``, whose size is the sum of the slices' k and whose
counts, if they can vary, come back with the round's one copy (``report``). The session's ``Fusion``
lets the first pass fold the gradient into the accumulator and the last one take the selected values
out of it (gather and zero), so error feedback costs no pass of its own.

``DeviceDecaying`` is ``updates.Decaying`` (value = scale * stored) with its scale on the device
and its renormalisations decided there, bit-identical to the host's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.feedback.updates import Decaying
from ..ops.select import radix, selection


@dataclass
class Fusion:
    """Error-feedback work a round lets the engine do inside its passes.

    ``accumulate``: (mode, accumulator, gradient, velocity, filtered, momentum) for the first
    pass over the accumulator (None once done, or when the session did it itself); ``take``:
    zero the accumulator (and ``velocity``) where the final selection is taken."""

    accumulate: tuple | None
    accumulator: object
    velocity: object = None


@dataclass
class DeviceSelection:
    """A selection on the device: ``indices`` (the engine's output, sorted per slice) and, if
    ``taken``, their ``values`` (already zeroed in the accumulator). Segment s holds
    ``indices[starts[s] : starts[s] + count_s]``; the counts are the k per slice unless
    ``variable``, when they are in ``report`` (copied back with the round)."""

    indices: object
    values: object
    report: object
    starts: np.ndarray
    ks: list
    taken: bool
    variable: bool = False
    engine: radix.RadixSelect | None = None
    # reports of earlier selections of the same round whose non-finite counts count too (a
    # candidate pool: the NaN it ranked last never reaches the final selection)
    also: tuple = ()

    @property
    def capacity(self) -> int:
        return int(sum(self.ks))

    def host_parts(self, report: np.ndarray) -> list[tuple[int, int]]:
        """[(start, count)] per segment, from the copied-back report."""
        counts = np.asarray(report).reshape(-1, radix.RP_W)[:, 0] if self.variable else self.ks
        return [(int(s), int(c)) for s, c in zip(self.starts, counts)]


class DeviceEngines:
    """The radix engines one policy uses, built once per (purpose, k per slice) and reused."""

    def __init__(self, dev, layout):
        self.dev, self.layout = dev, layout
        self._cache: dict = {}
        self._views: dict = {}
        self.index_dtype = np.int32 if layout.numel < 2 ** 31 else np.int64
        # (first, end): select only these slices (one bucket of layers, --overlap), else None
        self.layers: tuple[int, int] | None = None

    def _restricted(self, key: radix.Key, ks, segments):
        """The key, k and segments of the slices in ``layers`` (a per-slice ``pdev`` too)."""
        first, end = self.layers
        ks = list(ks)
        if len(ks) == len(self.layout.slices):  # per slice of the whole layout: these ones
            ks = ks[first:end]
        if segments is None:
            segments = [(o, o + n) for o, n in self.layout.slices[first:end]]
        if key.pdev is not None:
            view = self._views.get((id(key.pdev), first, end))
            if view is None:
                view = self._views[(id(key.pdev), first, end)] = key.pdev[first:end]
            key = radix.Key(key.mode, key.x, key.aux, key.mask, key.p0, view, key.gather)
        return key, ks, segments

    def engine(self, name: str, key: radix.Key, ks, segments=None, **options) -> radix.RadixSelect:
        """The engine for ``name`` at these k (built on first use; the same arrays every round
        for the built-in policies, re-pointed when a key's arrays change)."""
        segments = segments or [(o, o + n) for o, n in self.layout.slices]
        cache_key = (name, tuple(int(k) for k in ks), tuple(segments),
                     tuple(sorted((k, id(v)) for k, v in options.items())))
        engine = self._cache.get(cache_key)
        if engine is None:
            engine = self._cache[cache_key] = radix.RadixSelect(self.dev, segments, ks, key,
                                                                **options)
        elif any(getattr(engine.key, f) is not getattr(key, f)
                 for f in ("x", "aux", "mask", "pdev", "gather")) or engine.key.p0 != key.p0:
            engine.set_key(key)
        return engine

    ranks_every_key = True  # every radix.Key mode (the host's engines rank fewer)

    def at_least(self, x, lam: float):
        """Sorted indices of |x| >= lam in one array: array code on the device (what a policy
        that reads counts back every round, ``micro``, runs there)."""
        return selection.at_least(x, lam, None)

    def largest(self, values, count: int):
        """Sorted positions of the ``count`` largest |values| (ties to the lower position)."""
        xp = self.dev.xp
        return xp.sort(xp.argsort(-xp.abs(values), kind="stable")[:count])

    def topk(self, score, k: int, offset: int = 0):
        """Sorted indices of the k largest |score| of one array (a user's score on the
        device), relative to it: the engine over that array alone."""
        found = self.select(f"topk@{offset}", radix.Key(radix.KEY_ABS, score), [k], None,
                            final=False, values=False, segments=[(0, int(score.size))])
        return found.indices.astype(self.dev.xp.int64)

    def select(self, name: str, key: radix.Key, ks, fusion: Fusion | None, *,
               final: bool = True, exclude_zero: bool = False, values=True,
               segments=None) -> DeviceSelection:
        """The ks largest keys per slice as a ``DeviceSelection``. ``final``: the values are
        taken out of the accumulator (``fusion``'s); else (a proposal, a candidate pool) they are
        only read (``values``) or not at all. The fusion's pending accumulation runs in the
        first pass."""
        if self.layers is not None:
            key, ks, segments = self._restricted(key, ks, segments)
        take = final and fusion is not None
        read = fusion.accumulator if fusion is not None and (take or values) else None
        engine = self.engine(name, key, ks, segments, exclude_zero=exclude_zero,
                             index_dtype=self.index_dtype if final else np.int64,
                             values=read, take=take,
                             velocity=fusion.velocity if take else None)
        accumulate = None
        if fusion is not None and fusion.accumulate is not None:
            accumulate, fusion.accumulate = fusion.accumulate, None
        engine.run(accumulate)
        return DeviceSelection(engine.out_idx[:engine.total_k] if engine.total_k else
                               engine.out_idx[:0],
                               engine.out_val[:engine.total_k] if read is not None else None,
                               engine.report, engine.obase, engine.ks, take,
                               variable=exclude_zero, engine=engine)

    def mark(self, selection: DeviceSelection, mask, value: int) -> None:
        """mask[i] = value at every index a selection chose (on the device: the counts of a
        variable-count selection are read there)."""
        engine = selection.engine
        total = sum(engine.ks)
        self.dev.launch("psparse_mark", max(1, min(-(-total // 256), 8 * self.dev.sm_count)), (
            engine.out_idx, engine.segs, engine.report, np.int64(len(engine.segments)), mask,
            np.int32(value)))


def layout_bounds(layout) -> list[int]:
    """The edges of a layout's slices: [0, ..., numel]."""
    return [o for o, _ in layout.slices] + [layout.numel]


class DeviceIndexSet:
    """A set of indices the group shares (the last aggregate's) on the device: ``indices``
    and a byte mask of them that the radix engine reads (``KEY_PENALTY``); the host's is
    ``host_backend.HostIndexSet``."""

    def __init__(self, n: int, dev):
        self.xp = dev.xp
        self.indices = dev.xp.empty(0, dtype=dev.xp.int64)
        self.mask = dev.xp.zeros(n, dtype=dev.xp.uint8)

    def replace(self, indices) -> None:
        self.mask[self.indices] = 0
        self.indices = indices.astype(self.xp.int64)  # a copy: the upload buffer is reused
        self.mask[self.indices] = 1

    def within(self, offset: int, size: int):
        """The set's entries in [offset, offset + size), relative (a host-style path's)."""
        lo, hi = (int(i) for i in self.xp.searchsorted(
            self.indices, self.xp.asarray([offset, offset + size])))
        return self.indices[lo:hi] - offset


class DeviceDecaying(Decaying):
    """``Decaying`` on the device: ``stored`` there, ``scale`` a device double, renormalising
    (stored *= scale, flush below float32's smallest normal, scale = 1) decided by a kernel.
    With ``bounds`` (slice edges) it can track each slice's largest stored value (``top``)."""

    def __init__(self, n: int, dev, bounds=None):
        self.dev, self.xp = dev, dev.xp
        self.stored = dev.xp.zeros(n, dtype=dev.xp.float32)
        self.scale_dev = dev.xp.ones(1, dtype=dev.xp.float64)
        self.flag = dev.xp.zeros(1, dtype=dev.xp.int32)
        edges = bounds if bounds is not None else [0, n]
        self.bounds = dev.constant(np.asarray(edges, dtype=np.int64))
        self.nseg = len(edges) - 1
        self.top = dev.xp.zeros(max(1, self.nseg), dtype=dev.xp.float32)
        self._always = dev.xp.ones(1, dtype=dev.xp.int32)

    @property
    def scale(self) -> float:  # the host reads it only for checkpoints (state_dict)
        return float(self.dev.read(self.scale_dev)[0])

    def refresh_maxima(self) -> None:
        """top = each slice's largest stored value (after a restore)."""
        self.dev.launch("psparse_segment_max", min(self.nseg, 64 * self.dev.sm_count), (
            self.stored, self.bounds, np.int64(self.nseg), self.top, self._always))

    def decay(self, factor: float, track_max: bool = False) -> None:
        dev, n = self.dev, self.stored.size
        dev.launch("psparse_decay", 1, (self.scale_dev, np.float64(factor),
                                        np.float64(self.RENORMALISE_BELOW), self.flag,
                                        self.top, np.int64(self.nseg if track_max else 0)))
        self._renormalise_if_flagged(track_max, n)

    def _renormalise_if_flagged(self, track_max: bool, n: int) -> None:
        dev = self.dev
        dev.launch_over("psparse_renormalise", n, (self.stored, np.int64(n), self.scale_dev,
                                                   self.flag))
        if track_max:
            dev.launch("psparse_segment_max", min(self.nseg, 64 * dev.sm_count), (
                self.stored, self.bounds, np.int64(self.nseg), self.top, self.flag))
        dev.launch("psparse_renormalised", 1, (self.scale_dev, self.flag))

    def renormalise_above(self, limit: float) -> None:
        """ema's rule: renormalise when the largest tracked value passes ``limit`` while the
        scale is below 1 (then the maxima again)."""
        self.dev.launch("psparse_limit_check", 1, (self.top, np.int64(self.nseg),
                                                   np.float64(limit), self.scale_dev, self.flag,
                                                   self.top))
        self._renormalise_if_flagged(True, self.stored.size)

    def add(self, indices, values, weight: float, magnitude: bool = True, out=None,
            track_max: bool = False) -> None:
        if indices.size == 0:
            return
        kind = 2 if values is None else (0 if magnitude else 1)
        self.dev.launch_over("psparse_decaying_add", indices.size, (
            indices, self.dev.or_dummy(values, np.float32), np.int64(indices.size),
            np.float64(weight), np.int32(kind), self.scale_dev, self.stored, self.bounds,
            np.int64(self.nseg), self.top, np.int32(track_max)))

    def values(self):
        return self.stored * self.xp.asarray(self.scale_dev.astype(self.xp.float32))

    def state_dict(self) -> dict:
        return {"priority": self.stored, "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        host = np.asarray(state["priority"], dtype=np.float32)
        self.dev.upload("restore-priority", host, out=self.stored)
        self.dev.upload("restore-scale", np.array([float(state.get("scale", 1.0))]),
                        out=self.scale_dev)
