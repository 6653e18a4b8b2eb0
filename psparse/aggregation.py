"""The arithmetic of the server's rounds: pure array code, no sockets, no messages.

Everything here takes and returns plain arrays and ints; psparse/server.py hands it what the
workers sent (in rank order) and sends what it returns (docs/protocol.md, "Sequences" and
"Budgets"):

* ``Aggregator.mean``: the pushes summed in rank order into one model-sized scratch
  accumulator (host numpy, or CuPy with ``--server-device cuda``), divided by their number, at
  the sorted union of their indices; a dense push covers every index.
* ``Aggregator.vote``: the two-phase vote, the ``keep`` proposed indices of largest mean |value|
  (``candidates``: the same with their scores, what a key-range shard sends).
* ``Aggregator.check_budget``: a push or proposal against the step the agreed run sets for its
  iteration; ``BudgetError`` says how it breaks it (the server answers it as a protocol error).
* ``Aggregator.goes_dense`` / ``densify``: the dense switch at the model's natural index size.
* ``ServerLimit``: ``--server-limit``, a cap on the entries broadcast per round that loses
  nothing.
"""

from __future__ import annotations

import numpy as np

from .kernels import sorted_union, sparse_mean
from .protocol import dense_is_smaller, index_dtype_for
from .sparsify import topk_exact
from .xp import cupy_or_none, to_host

__all__ = ["Aggregator", "BudgetError", "ServerLimit", "array_module_for"]


class BudgetError(ValueError):
    """A push or proposal breaks the agreed run's budget; the text says how."""


def array_module_for(device: str):
    """Where the server sums the pushes: numpy, or CuPy for "cuda" (ValueError without it)."""
    if device != "cuda":
        return np
    xp = cupy_or_none()
    if xp is None:
        raise ValueError("--server-device cuda: no CUDA device, or CuPy is not installed")
    return xp


class Aggregator:
    """The round arithmetic for one model of ``numel`` entries.

    Holds the server's only model-sized buffers: pushes are summed into ``accumulator``, then
    the touched entries are read out and zeroed again, so no round allocates or clears numel
    floats. Results always come back as host (numpy) arrays.
    """

    def __init__(self, numel: int, xp=np):
        self.numel = numel
        self.xp = xp
        self.accumulator = xp.zeros(numel, dtype=xp.float32)
        self.index_dtype = index_dtype_for(numel)  # the natural index size (dense switch)
        self._dense_out = np.empty(numel, dtype=np.float32)  # for dense broadcasts
        self._all_indices = None

    @property
    def all_indices(self) -> np.ndarray:
        """Every index of the model: where a dense push has its values."""
        if self._all_indices is None:
            self._all_indices = np.arange(self.numel, dtype=np.int64)
        return self._all_indices

    def mean(self, indices: list, values: list) -> tuple[np.ndarray, np.ndarray]:
        """(sorted union of the pushes' indices, their mean there), summed in list order.

        ``indices[i]`` None is a dense push: ``values[i]`` is the whole vector. The sum runs in
        list (rank) order, so on the host the result does not depend on arrival order.
        """
        union, mean = sparse_mean(self.accumulator,
                                  [self.all_indices if i is None else i for i in indices],
                                  values)
        return to_host(union), to_host(mean)

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
        union, mean_abs = (to_host(a) for a in sparse_mean(
            self.accumulator, list(indices), [np.abs(v) for v in values]))
        if keep >= union.size:
            return union, mean_abs, int(union.size)
        chosen = topk_exact(mean_abs, keep, nonnegative=True)
        return union[chosen], mean_abs[chosen], int(union.size)

    def goes_dense(self, count: int) -> bool:
        """The dense switch: ``count`` (index, value) pairs at the natural index size are larger
        than all numel values."""
        return dense_is_smaller(count, self.numel, self.index_dtype)

    def densify(self, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The whole vector: ``values`` at ``indices``, zero elsewhere (a buffer reused by every
        call: send it before the next)."""
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
        candidates = sorted_union([union, self.support])
        values = self.residual[candidates]  # fancy indexing: a copy
        values[np.searchsorted(candidates, union)] += mean
        self.residual[self.support] = 0.0
        if candidates.size <= limit:
            self.support = np.empty(0, dtype=np.int64)
            return candidates, values
        keep = topk_exact(values, limit)
        held = np.ones(candidates.size, dtype=bool)
        held[keep] = False
        self.support = candidates[held]
        self.residual[self.support] = values[held]
        return candidates[keep], values[keep]
