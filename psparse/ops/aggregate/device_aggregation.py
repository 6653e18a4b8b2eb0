"""The server's round arithmetic on a GPU (``--server-device cuda``): no sort, one copy each way.

``DeviceAggregator.mean`` is ``Aggregator.mean`` on the device, bit for bit:

1. all pushes go up in one asynchronous copy each (indices, values) from pinned memory;
2. one scatter kernel per push, in rank order, adds it into the model-sized sum and sets a
   byte per touched entry (a push's indices are distinct: no atomics, and every entry's
   additions happen in the host's order, so the sums are the host's);
3. the union is the touched entries, written in index order by the radix engine's ordered
   compaction (``radix.KEY_MASK``, every set byte selected: no sort of the N·k pushed
   indices), their sums read and zeroed there, the bytes cleared, the sums divided by N;
4. one copy back (the union, the means, the count), then the wait.

The sum and the bytes are left zeroed, so no round clears the model.
"""

from __future__ import annotations

import numpy as np

from ..select import radix


class DeviceAggregator:
    """Sums of pushes at their union on a device backend (``psparse.backends.cuda``)."""

    def __init__(self, numel: int, dev):
        self.numel, self.dev = numel, dev
        xp = dev.xp
        self.sum = xp.zeros(numel, dtype=xp.float32)
        self.touched = xp.zeros(numel, dtype=xp.uint8)
        self._union = None  # the ordered compaction of the touched entries (built once)
        self._idx = xp.zeros(1, dtype=xp.int64)
        self._val = xp.zeros(1, dtype=xp.float32)

    def _compaction(self) -> radix.RadixSelect:
        if self._union is None:
            self._union = radix.RadixSelect(
                self.dev, [(0, self.numel)], [self.numel],
                radix.Key(radix.KEY_MASK, self.sum, mask=self.touched), exclude_zero=True,
                values=self.sum, take=True)
        return self._union

    def mean(self, indices: list, values: list) -> tuple[np.ndarray, np.ndarray]:
        """(sorted union of the pushes' indices, their mean there), as host arrays; a push's
        indices None: a dense push (its values are the whole vector)."""
        dev, xp = self.dev, self.dev.xp
        if not indices:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        sizes = [self.numel if i is None else len(i) for i in indices]
        total = sum(sizes)
        with dev.stream_scope():
            flat_idx = np.concatenate([np.asarray(i, dtype=np.int64) for i in indices
                                       if i is not None] or [np.empty(0, np.int64)])
            flat_val = np.concatenate([np.asarray(v, dtype=np.float32) for v in values])
            up_idx = dev.upload("pushed-indices", flat_idx, out=self._grow("_idx", flat_idx.size,
                                                                           xp.int64))
            up_val = dev.upload("pushed-values", flat_val, out=self._grow("_val", total,
                                                                          xp.float32))
            at_idx = at_val = 0
            for push, size in zip(indices, sizes):
                if size:
                    if push is None:
                        dev.launch_over("psparse_dense_add", size, (
                            up_val[at_val:at_val + size], np.int64(size), self.sum,
                            self.touched))
                    else:
                        dev.launch_over("psparse_push_add", size, (
                            up_idx[at_idx:at_idx + size], up_val[at_val:at_val + size],
                            np.int64(size), self.sum, self.touched))
                        at_idx += size
                at_val += size
            union = self._compaction()
            union.run()
            dev.launch("psparse_mark", max(1, min(-(-total // 256), 8 * dev.sm_count)), (
                union.out_idx, union.segs, union.report, np.int64(1), self.touched,
                np.int32(0)))
            dev.launch_over("psparse_divide", min(total, self.numel), (
                union.out_val, union.report, np.float32(len(values))))
            cap = min(total, self.numel)
            report = dev.pinned("union-report", radix.RP_W, np.int64)
            idx = dev.pinned("union-indices", cap, np.int64)
            mean = dev.pinned("union-means", cap, np.float32)
            dev.copy_back([(union.report, report), (union.out_idx[:cap], idx),
                           (union.out_val[:cap], mean)])
        count = int(report[0])
        return idx[:count].copy(), mean[:count].copy()

    def _grow(self, name: str, size: int, dtype):
        held = getattr(self, name)
        if held.size < size:
            held = self.dev.xp.zeros(max(size, 2 * held.size), dtype=dtype)
            setattr(self, name, held)
        return held[:size]
