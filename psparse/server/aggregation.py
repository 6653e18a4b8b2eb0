"""The arithmetic of the server's rounds: pure array code, no sockets, no messages.

Everything here takes and returns plain arrays and ints; psparse/server.py hands it what the
workers sent (in rank order) and sends what it returns (docs/protocol.md, "Sequences" and
"Budgets"):

* ``Aggregator.mean``: the pushes summed in rank order, divided by their number, at the sorted
  union of their indices; a dense push covers every index. On the host a compiled kernel
  (``agg_kernels.sparse_sum``) reads the received frames where they lie and sums them block by block
  through a cache-sized bitmap into the output; with ``--server-device cuda`` the GPU sums them in
  rank order and finds the union from touched bytes (``psparse.ops.aggregate.device_aggregation``),
  bit for bit the same.
* ``Aggregator.vote``: the two-phase vote, the ``keep`` proposed indices of largest mean |value|
  (``candidates``: the same with their scores, what a key-range shard sends).
* ``Aggregator.check_budget``: a push or proposal against the step the agreed run sets for its
  iteration; ``BudgetError`` says how it breaks it (the server answers it as a protocol error).
* ``Aggregator.goes_dense`` / ``densify``: the dense switch at the model's natural index size.
* ``ServerLimit``: ``--server-limit``, a cap on the entries broadcast per round that loses
  nothing.
* ``BroadcastMemory``: with ``--values`` other than fp32, the broadcast's rounding error, kept
  and added into the next round's aggregate where it broadcasts again.
"""

from __future__ import annotations

import numpy as np

from ..ops.aggregate import reference
from ..ops.aggregate.device_aggregation import DeviceAggregator
from ..ops.jit import REFERENCE, LazyModule, Reusable, address_table, compiled
from ..ops.select.selection import NonFiniteError
from ..ops.values.formats import FP32, ValueFormat
from ..wire.protocol import all_finite, dense_is_smaller, index_dtype_for
from ..xp import cupy_or_none

agg_kernels = LazyModule("psparse.ops.aggregate.agg_kernels")
__all__ = ["Aggregator", "BroadcastMemory", "BudgetError", "ServerLimit", "array_module_for"]


class BudgetError(ValueError):
    """A push or proposal breaks the agreed run's budget; the text says how."""


def array_module_for(device: str):
    """Where the server sums the pushes: None (the host), or a device backend for "cuda"
    (``psparse.backends.cuda.CudaBackend``; ValueError without a CUDA device and CuPy)."""
    if device != "cuda":
        return None
    from ..backends.devices import emulated_from_env
    emulated = emulated_from_env()  # PSPARSE_EMULATE_GPU: the GPU path on the CPU (tests)
    if emulated is not None:
        return emulated
    xp = cupy_or_none()
    if xp is None:
        raise ValueError("--server-device cuda: no CUDA device, or CuPy is not installed")
    from ..backends.cuda import CudaBackend
    return CudaBackend(xp)


class Aggregator:
    """The round arithmetic for one model of ``numel`` entries.

    On the host the pushes are summed block by block through a bitmap of at most 2**20 bits
    (``agg_kernels``), left zeroed after every round; the model-sized ``accumulator`` is used
    only by a dense push. Results always come back as host (numpy) arrays.
    """

    def __init__(self, numel: int, dev=None, value_format: ValueFormat = FP32):
        self.numel = numel
        self.value_format = value_format  # the run's --values: where the dense switch lies
        # on a device (--server-device cuda): psparse.ops.aggregate.device_aggregation, bit for bit
        # the host
        self._device = DeviceAggregator(numel, dev) if dev is not None else None
        self._accumulator = None
        self.index_dtype = index_dtype_for(numel)  # the natural index size (dense switch)
        self._dense_out = None  # for dense broadcasts, allocated by the first
        self._all_indices = None
        self._outputs = Reusable()
        self._bits = self._offsets = np.empty(0)  # sized by the first round's block

    @property
    def accumulator(self):
        """The model-sized scratch (zeroed between rounds): on the host allocated only when a
        dense push (or the numpy reference) first needs it."""
        if self._accumulator is None:
            self._accumulator = np.zeros(self.numel, dtype=np.float32)
        return self._accumulator

    @property
    def all_indices(self) -> np.ndarray:
        """Every index of the model: where a dense push has its values."""
        if self._all_indices is None:
            self._all_indices = np.arange(self.numel, dtype=np.int64)
        return self._all_indices

    def mean(self, indices: list, values: list) -> tuple[np.ndarray, np.ndarray]:
        """(sorted union of the pushes' indices, their mean there), summed in list order.

        ``indices[i]`` None is a dense push: ``values[i]`` is the whole vector. The sum runs in
        list (rank) order, so on the host the result does not depend on arrival order. The
        pushes' indices are sorted and duplicate-free in [0, numel), as the protocol
        guarantees. The union is in the model's natural index dtype (int32 up to 2**31 - 1
        entries: what the broadcast sends) whatever the pushes' (a delta-coded push decodes to
        int64), and int64 with a dense push (every index).
        """
        if self._device is not None:
            return self._on_device(indices, values)
        if REFERENCE:  # the numpy reference on the host
            union, mean = reference.sparse_mean(
                self.accumulator, [self.all_indices if i is None else i for i in indices],
                values)
            return union, mean
        if not compiled(self._entries(indices, values)):
            return self._small_mean(indices, values)
        return self._host_sum(indices, values, absolute=False)

    def _entries(self, indices: list, values: list) -> int:
        """What the numpy reference's sum would touch: the pushed entries, and the model-sized
        accumulator's zeroing of those entries (so at most a small model's)."""
        return max(sum(len(v) for v in values), self.numel)

    def _small_mean(self, indices: list, values: list):
        """``mean`` of a small round by the numpy reference (jit.SMALL), returned as the
        kernel's: the union in the model's index dtype, int64 with a dense push or none."""
        if not values:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        dense = any(i is None for i in indices)
        for i, v in zip(indices, values):
            if i is not None and len(i) != len(v):
                raise ValueError(f"a push has {len(v)} values for {len(i)} indices")
        union, mean = reference.sparse_mean(
            self.accumulator, [self.all_indices if i is None else i for i in indices],
            [np.asarray(v, dtype=np.float32) for v in values])
        if dense:
            return self.all_indices, mean
        return union.astype(self.index_dtype, copy=False), mean

    def _on_device(self, indices: list, values: list):
        """The device's (union, mean), the union in the host path's index dtype."""
        union, mean = self._device.mean(indices, values)
        dense = any(i is None for i in indices)
        return union.astype(np.int64 if dense else self.index_dtype, copy=False), mean

    def _host_sum(self, indices: list, values: list, absolute: bool):
        """The compiled rank-order sum (of |value| with ``absolute``) over the pushes, divided
        by their number: (union, mean)."""
        pushes = len(values)
        if pushes == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        values = [np.ascontiguousarray(v, dtype=np.float32) for v in values]
        dense = np.array([i is None for i in indices], dtype=np.bool_)
        given = [np.ascontiguousarray(i) for i in indices if i is not None]
        dtype = np.result_type(*given) if given and not dense.any() else np.dtype(np.int64)
        if dtype not in (np.int32, np.int64):
            dtype = np.dtype(np.int64)
        index_arrays = [self.all_indices if i is None else np.ascontiguousarray(i, dtype=dtype)
                        for i in indices]  # a dense push's entry: never read, only its length
        for i, v in zip(index_arrays, values):
            if i.size != v.size:
                raise ValueError(f"a push has {v.size} values for {i.size} indices")
        index_addresses, lengths = address_table(index_arrays)
        value_addresses, _ = address_table(values)
        divisor = np.float32(pushes)
        proto = np.empty(0, dtype)  # the indices' dtype, for the kernel's views
        if dense.any():
            out = np.empty(self.numel, np.float32)
            agg_kernels.dense_sum(self.accumulator, index_addresses, value_addresses, lengths,
                                  dense, proto, absolute, out, divisor)
            return self.all_indices, out
        total = int(lengths.sum())
        out_index = self._outputs.take(total, self.index_dtype)
        out_value = self._outputs.take(total, np.float32)
        block_bits = agg_kernels.block_bits_for(self.numel)
        if self._bits.size < max(1, (1 << block_bits) // 64):  # zeroed, left zeroed
            self._bits = np.zeros(max(1, (1 << block_bits) // 64), np.uint64)
            self._offsets = np.empty(self._bits.size, np.uint32)
        count = agg_kernels.sparse_sum(
            index_addresses, value_addresses, lengths, proto, absolute, out_index, out_value,
            block_bits, self._bits, self._offsets)
        agg_kernels.divide(out_value, count, divisor)
        return out_index[:count], out_value[:count]

    def vote(self, indices: list, values: list, keep: int) -> tuple[np.ndarray, int]:
        """The two-phase vote over proposals given in rank order: the sorted ``keep`` proposed
        indices of largest mean |value| (ties: the lower index; all of them if fewer were
        proposed), and how many distinct indices were proposed."""
        kept, _, proposed = self.candidates(indices, values, keep)
        return kept, proposed

    def candidates(self, indices: list, values: list,
                   keep: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``vote`` with the scores: (the kept indices, their mean |value|, how many distinct
        indices were proposed). A key-range shard sends these, and the workers keep the best
        ``keep`` over all shards by the same rule (a global best is among its shard's best)."""
        if self._device is not None:
            union, mean_abs = self._on_device(list(indices), [np.abs(v) for v in values])
        elif REFERENCE:
            return reference.candidates(self.accumulator, indices, values, keep)
        else:
            union, mean_abs = self._host_sum(list(indices), list(values), absolute=True)
        if keep >= union.size:
            return union, mean_abs, int(union.size)
        chosen = top_k(mean_abs, keep, nonnegative=True)
        return union[chosen], mean_abs[chosen], int(union.size)

    def goes_dense(self, count: int) -> bool:
        """The dense switch: ``count`` (index, value) pairs at the natural index size are larger
        than all numel values (in the run's value format)."""
        return dense_is_smaller(count, self.numel, self.index_dtype, self.value_format)

    def densify(self, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The whole vector: ``values`` at ``indices``, zero elsewhere (a buffer reused by every
        call: send it before the next)."""
        if self._dense_out is None:
            self._dense_out = np.empty(self.numel, dtype=np.float32)
        self._dense_out[:] = 0.0
        self._dense_out[indices] = values
        return self._dense_out

    def check_budget(self, kind: str, it: int, step, count: int,
                     dense_values: np.ndarray | None = None) -> None:
        """Raise ``BudgetError`` unless a ``kind`` ("push" or "propose") of ``count`` entries
        keeps to ``step`` = (budget, push_max, propose_max), the agreed step at iteration ``it``.

        A dense push (``dense_values``: the whole vector) is allowed only where the push cap
        makes dense the smaller form, and counts its nonzero values (-0.0 is zero).
        """
        _, push_max, propose_max = step
        if dense_values is not None:
            if not self.goes_dense(push_max):
                raise BudgetError(f"dense push refused: the push cap at iteration {it} is "
                                  f"{push_max} of {self.numel} entries, which go sparse")
            count = int(np.count_nonzero(dense_values))
            if count > push_max:
                raise BudgetError(f"dense push has {count} nonzero entries, more than the "
                                  f"push cap of {push_max} at iteration {it}")
            return
        cap = propose_max if kind == "propose" else push_max
        if count > cap:
            raise BudgetError(f"{kind} has {count} entries, more than the cap of {cap} at "
                              f"iteration {it} (agreed run, step {list(step)})")


class ServerLimit:
    """A cap on the entries broadcast per round that loses nothing.

    When the round's aggregate (plus what earlier rounds held back) has more than L entries, the
    L of largest |value| are broadcast and the rest stays in a server-side residual that is
    added to the next round's aggregate -- gTop-k returns its cut to residuals for the same
    reason. Invariant: sum over rounds of the pushes' mean = sum of broadcasts + residual.
    """

    def __init__(self, numel: int, spec: tuple[float, str]):
        self.spec = spec
        self.residual = np.zeros(numel, dtype=np.float32)  # in aggregate (mean) units
        self.support = np.empty(0, dtype=np.int64)  # sorted indices where residual != 0

    def entries(self, k: int, world_size: int, shard: tuple[int, int] = (0, 1)) -> int:
        """The round's cap. For shard I of S key-range servers, its part of the whole run's
        cap L: L * (I + 1) // S - L * I // S entries (the parts sum to L), at least 1."""
        mult, unit = self.spec
        if unit == "entries":
            total = int(mult)
        elif unit == "Nk":
            total = world_size * k
        else:
            total = max(1, int(round(mult * k)))
        index, count = shard
        return max(1, total * (index + 1) // count - total * index // count)

    def apply(self, union: np.ndarray, mean: np.ndarray,
              limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) to broadcast; the residual keeps the rest."""
        if self.support.size == 0 and union.size <= limit:
            return union, mean
        if REFERENCE:
            sent = reference.limit_apply(self, union, mean, limit)
            for keys, values in (sent, (self.support, self.residual[self.support])):
                _finite_or_raise(values, keys, "the mean plus the size limit's residual")
            return sent
        capacity = union.size + self.support.size
        candidates = np.empty(capacity, np.int64)
        values = np.empty(capacity, np.float32)
        count = agg_kernels.merge_residual(np.ascontiguousarray(union), mean, self.support,
                                           self.residual, candidates, values)
        candidates, values = candidates[:count], values[:count]
        _finite_or_raise(values, candidates, "the mean plus the size limit's residual")
        if count <= limit:
            self.support = np.empty(0, dtype=np.int64)
            return candidates, values
        kept = top_k(values, limit)
        kept_index, kept_value = np.empty(limit, np.int64), np.empty(limit, np.float32)
        self.support = np.empty(count - limit, np.int64)
        agg_kernels.partition_kept(candidates, values, kept, kept_index, kept_value,
                                   self.support, self.residual)
        return kept_index, kept_value


class BroadcastMemory:
    """The server's error memory for rounded broadcasts (``--values``; DoubleSqueeze's server
    memory, Tang et al. 2019), over the ``numel`` keys one server holds.

    A broadcast sends R(a + e) at its indices, where a is the round's aggregate (after the size
    limit), e this memory there and R the value format's rounding, in the layout of the frame
    (sparse or dense); then e = (a + e) - R(a + e) there. Entries elsewhere keep their error
    until their index is broadcast again, so the broadcast's size does not change.
    Invariant (``keep``): sum over rounds of the aggregates = sum of the broadcasts + memory.
    Without ``keep`` (``--no-broadcast-memory``) the error is dropped. With ``--server-limit``
    this is a second memory beside the limit's: the limit holds back whole entries, this one
    the rounding error of those sent (docs/api.md, Value formats)."""

    def __init__(self, numel: int, value_format: ValueFormat, keep: bool = True):
        self.value_format = value_format
        self.residual = np.zeros(numel, dtype=np.float32) if keep else None

    def sparse(self, indices: np.ndarray, values: np.ndarray, offset: int = 0) -> np.ndarray:
        """The values to broadcast at ``indices`` (+ ``offset``: a part's first key)."""
        if self.residual is None:
            return self.value_format.round(values)
        keys = np.asarray(indices, dtype=np.int64) + offset
        target = values + self.residual[keys]
        _finite_or_raise(target, keys)
        sent = self.value_format.round(target)
        self.residual[keys] = target - sent
        return sent

    def dense(self, indices: np.ndarray, values: np.ndarray, vector: np.ndarray,
              offset: int = 0) -> np.ndarray:
        """The whole ``vector`` to broadcast (``values`` at ``indices``, zero elsewhere: the
        layout a dense frame rounds in), rounded."""
        if self.residual is None:
            return self.value_format.round(vector)
        keys = np.asarray(indices, dtype=np.int64) + offset
        vector[indices] += self.residual[keys]
        _finite_or_raise(vector[indices], keys)
        sent = self.value_format.round(vector)
        self.residual[keys] = vector[indices] - sent[indices]
        return sent

    def state(self) -> dict:
        """The memory's nonzero entries (a checkpoint's)."""
        # (by bits: a -0.0 is kept too, so a resumed run rounds exactly as the one it resumes)
        support = np.flatnonzero(self.residual.view(np.uint32)) \
            if self.residual is not None else np.empty(0, np.int64)
        return {"support": support, "values": self.residual[support]
                if self.residual is not None else np.empty(0, np.float32)}

    def restore(self, state: dict) -> None:
        if self.residual is not None:
            self.residual[:] = 0.0
            self.residual[state["support"]] = state["values"]


def _finite_or_raise(target: np.ndarray, keys: np.ndarray,
                     what: str = "the mean plus the broadcast's rounding memory") -> None:
    """A round's values with what a memory held added are finite (the memory would keep an
    inf for ever), else NonFiniteError naming the first key that is not (``key``: as ``keys``
    give it, the shard's or part's)."""
    if not all_finite(target):  # (one compiled pass, no temporary array)
        error = NonFiniteError(what)
        error.key = int(keys[np.flatnonzero(~np.isfinite(target))[0]])
        raise error


def top_k(x: np.ndarray, k: int, nonnegative: bool = False) -> np.ndarray:
    """Sorted positions of the k largest |x| (exact; ties to the lower position), as
    ``sparsify.topk_exact``, compiled (``agg_kernels.top_k``). ``nonnegative``: x >= 0."""
    n = x.size
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    out = np.empty(k, dtype=np.int64)
    if agg_kernels.top_k(np.ascontiguousarray(x, dtype=np.float32), k, nonnegative, out) < 0:
        raise NonFiniteError("the accumulator holds NaN or inf")
    return out
