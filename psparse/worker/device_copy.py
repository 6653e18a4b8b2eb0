"""A GPU round's selection on its way to the host: one copy back, the policy's output checked.

``SelectionCopy`` takes what a policy chose on the device (the radix engine's selection, or
plain indices checked for range and order by a kernel) and brings the pairs to pinned host
memory with the round's other small results in the same copy (``psparse/worker/device_round.py``).
With a value format other than float32 a push's values come back already rounded, as the
frames' scales and codes (``psparse/worker/device_values.py``).
"""

from __future__ import annotations

import os

import numpy as np

from ..backends.device_engines import DeviceSelection
from ..ops.select.radix import RP_W
from ..policies import PolicyError, check_output
from .device_values import DeviceValues
from .divergence import accumulator_diverged
from .exchange import RoundContext

FLAG_RANGE, FLAG_ORDER = 0, 1
BOUNDED_FROM = 1024  # a variable selection of more capacity is copied back near its count
RECENT = 8  # rounds whose largest count sets the next round's copy


class SelectionCopy:
    """A selection's way to the host: (indices, values) through one copy back (with the
    round's ``extra`` pairs), the policy's output checked. The pinned buffers are the method's
    and the part's: ZeroMQ sends them without a copy, and parts are in flight together (each
    buffer is reused once its round's aggregate has come back)."""

    def __init__(self, ctx: RoundContext, dev):
        self.s, self.dev = ctx, dev
        self.numel = ctx.net.numel
        self.flags = dev.xp.zeros(2, dtype=dev.xp.uint64)  # the check kernel's findings
        self.rounding = DeviceValues(ctx, dev)  # --values: a push rounded on the device
        # variable selections (_bounded): the entries to copy back next round, per tag, from
        # the counts of the last rounds
        self.expected: dict[str, int] = {}
        self.recent: dict[str, list[int]] = {}

    def copy_back(self, it, chosen, limit, method, extra=(), part: int = 0):
        if isinstance(chosen, DeviceSelection):
            return self._engine(it, chosen, f"{method}{part}", method, extra, part)
        return self._indices(it, chosen, limit, method, f"{method}{part}", extra, part)

    def _engine(self, it, chosen: DeviceSelection, tag: str, method: str, extra, part: int):
        """The engine's selection: its report, indices and values (and earlier reports)."""
        if chosen.variable and chosen.capacity > BOUNDED_FROM and chosen.values is not None:
            return self._bounded(it, chosen, tag, extra)
        dev = self.dev
        cap = chosen.capacity
        report = dev.pinned("report", chosen.report.size, np.int64)
        idx = dev.pinned(f"{tag}-idx", cap, chosen.indices.dtype)
        val = dev.pinned(f"{tag}-val", cap, np.float32)
        if chosen.taken:  # gathered and zeroed by the engine: what follows a take
            self.s.memory.after_take()
        pairs = [(chosen.report, report), (chosen.indices, idx)]
        rounded = None
        if chosen.values is not None and method == "select" and \
                self.rounding.active(cap, part):
            more, rounded = self.rounding.stage(
                tag, chosen.indices, chosen.values, chosen.starts, chosen.ks,
                chosen.report if chosen.variable else None)
            pairs += more  # the frames' codes come back instead of the float32 values
        elif chosen.values is not None:
            pairs.append((chosen.values, val))
        earlier = [dev.pinned(f"report-{n}", r.size, np.int64)
                   for n, r in enumerate(chosen.also)]
        pairs += list(zip(chosen.also, earlier))
        dev.copy_back(pairs + list(extra))
        if self._overflowed(it, [report, *earlier]):
            return np.empty(0, np.int64), np.empty(0, np.float32)
        parts = chosen.host_parts(report)
        if len(parts) > 1 or parts[0][0] != 0 or parts[0][1] != cap:
            keep = np.concatenate([np.arange(b, b + c) for b, c in parts]) if parts else \
                np.empty(0, np.int64)
            idx, val = idx[keep], val[keep]
        if chosen.values is None:
            raise AssertionError(f"{method}: a selection without its values")
        return idx, (val if rounded is None else rounded())

    def _bounded(self, it, chosen: DeviceSelection, tag: str, extra):
        """A variable selection whose capacity is far above what it selects (``threshold``'s
        is the whole model by default): compacted on the device, then copied back only up to
        ``expected`` entries, an estimate from the last rounds (twice the largest count of the
        last RECENT, at least BOUNDED_FROM; the first round copies its whole capacity). A round
        that selected more copies the rest in a second copy back (a second wait, counted in
        the backend's copy_backs); the estimate then grows. Values are rounded on the host
        here (--values)."""
        dev = self.dev
        cap = chosen.capacity
        if chosen.taken:
            self.s.memory.after_take()
        indices, values, layout = self.rounding.compact(tag, chosen)
        # the first round has no count to go by: all of its capacity, unless
        # PSPARSE_COPY_BACK_FIRST gives a first estimate (entries; the tests use it)
        first = os.environ.get("PSPARSE_COPY_BACK_FIRST", "")
        expect = min(cap, self.expected.get(tag, int(first) if first.isdigit() else cap))
        report = dev.pinned("report", chosen.report.size, np.int64)
        idx = dev.pinned(f"{tag}-idx", cap, chosen.indices.dtype)
        val = dev.pinned(f"{tag}-val", cap, np.float32)
        earlier = [dev.pinned(f"report-{n}", r.size, np.int64) for n, r in enumerate(chosen.also)]
        dev.copy_back([(chosen.report, report), (indices[:expect], idx[:expect]),
                       (values[:expect], val[:expect]), *zip(chosen.also, earlier), *extra])
        if self._overflowed(it, [report, *earlier]):
            return np.empty(0, np.int64), np.empty(0, np.float32)
        total = sum(count for _, count in chosen.host_parts(report))
        if total > expect:  # more than expected: the rest, in a second copy back
            dev.copy_back([(indices[expect:total], idx[expect:total]),
                           (values[expect:total], val[expect:total])])
        recent = self.recent.setdefault(tag, [])
        recent.append(total)
        del recent[:-RECENT]
        self.expected[tag] = max(BOUNDED_FROM, 2 * max(recent))
        return idx[:total], val[:total]

    def _overflowed(self, it: int, reports) -> bool:
        """Whether the engine's copied-back reports count NaN or inf scores: an overflow
        under a GradScaler (the round sends nothing), else a diverged run (WorkerError)."""
        bad = sum(int(r.reshape(-1, RP_W)[:, 1].sum()) for r in reports)
        if bad and self.s.scaling is None:
            raise accumulator_diverged(it, f"the accumulator holds {bad} NaN or inf entries")
        return bool(bad)

    def _indices(self, it, chosen, limit, method: str, tag: str, extra, part: int):
        """Plain indices from the policy (device or host): checked on the device (range,
        order), their values taken, one copy back."""
        dev, policy = self.dev, self.s.policy
        if isinstance(chosen, np.ndarray) or not (hasattr(chosen, "dtype") and
                                                  hasattr(chosen, "ndim")):
            # indices the policy made on the host: checked there, then one upload
            check_output(policy, chosen, it, limit, method)
            chosen = dev.upload("policy-output", np.asarray(chosen, dtype=np.int64))
        if chosen.ndim != 1 or chosen.dtype.kind not in "iu":
            check_output(policy, chosen, it, limit, method)  # the host's message for it
        if chosen.size > limit:
            raise PolicyError(f"policy {type(policy).__name__}.{method}() at iteration {it} "
                              f"returned {chosen.size} indices, more than its budget of {limit}")
        chosen = chosen.astype(np.int64)
        self.flags.fill(0)
        if chosen.size:
            dev.launch_over("psparse_check_indices", chosen.size, (
                chosen, np.int64(chosen.size), np.int64(self.numel), self.flags))
        values = self.s.memory.take(chosen) if method == "select" else \
            self.s.memory.accumulator[chosen]
        flags = dev.pinned("flags", 2, np.uint64)
        idx = dev.pinned(f"{tag}-idx", chosen.size, np.int64)
        val = dev.pinned(f"{tag}-val", chosen.size, np.float32)
        pairs, rounded = [(values, val)], None
        if method == "select" and self.rounding.active(chosen.size, part):  # codes instead
            pairs, rounded = self.rounding.stage(tag, chosen, values, [0], [chosen.size])
        dev.copy_back([(self.flags, flags), (chosen, idx), *pairs] + list(extra))
        where = f"policy {type(policy).__name__}.{method}() at iteration {it}"
        if flags[FLAG_RANGE]:
            raise PolicyError(f"{where} returned an index out of range [0, {self.numel})")
        if flags[FLAG_ORDER]:
            raise PolicyError(f"{where} returned indices that are not strictly increasing "
                              "(they must be sorted, without duplicates)")
        return idx, (val if rounded is None else rounded())
