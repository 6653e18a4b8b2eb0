"""The selection-policy plug-in point: which k entries of its accumulator a worker sends.

A policy is a small class. The runtime calls, on every worker, every iteration:

    indices = policy.select(accumulator, iteration)        # sorted int64 indices to push
    ...push, receive the aggregate...
    policy.observe(agg_indices, agg_values, iteration)     # the same bytes on every worker

``observe`` sees only the aggregate, which is identical on every worker, so any state built from
it is identical everywhere: that is how policies steer workers toward the same indices without
extra messages. ``select`` may use that shared state and the worker's own accumulator.

The easiest override is ``score``: the default ``select`` takes, per slice (the whole model, or
each layer with ``--granularity layer``), the k entries of largest score; the default score is
|accumulator| (plain top-k). Override ``select_slice`` to change how a slice is chosen, or
``select`` for everything.

Two-phase policies (``two_phase = True``: ``cltk``, ``vote``) get a first step each round: every
worker's ``propose(accumulator, iteration)`` returns indices (or None) and the worker sends its
accumulator values there; the server keeps the ``group_k`` proposed indices of largest mean
|value| (all of them if fewer were proposed) and sends them back, and ``select(accumulator,
iteration, group=those indices)`` decides what to push.

Parameters are declared in ``params`` (name -> Param) and arrive as attributes, converted and
validated; ``--policy-arg name=value`` sets them. See docs/policies.md for a complete example.

Arrays live where the accumulator lives: ``self.xp`` is numpy, or CuPy when the worker runs with
``--device cuda``; write array code as ``self.xp.abs(...)`` (not ``np.abs``) and it runs on both.
``observe`` then gets its indices and values on that device too.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.device_engines import Fusion
from ..backends.host import HostBackend
from ..ops.jit import host_compiled
from ..ops.select import radix
from ..ops.select.sparsify import Selector, split_k
from ..option_rules import dense_warmup_refusal


class PolicyError(ValueError):
    """Unknown policy or bad policy parameter; the text lists what is valid."""


@dataclass(frozen=True)
class Param:
    """A declared policy parameter: its type, default, help, and an optional check."""

    type: type
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    check_text: str = ""

    def convert(self, name: str, raw: Any) -> Any:
        try:
            if self.type is bool and isinstance(raw, str):
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                value = raw.lower() in ("true", "1", "yes")
            else:
                value = self.type(raw)
        except (TypeError, ValueError):
            raise PolicyError(f"parameter {name}={raw!r}: expected {self.type.__name__}") from None
        if self.check is not None and not self.check(value):
            raise PolicyError(f"parameter {name}={value!r}: must be {self.check_text}")
        return value


class Layout:
    """How the flat parameter vector is cut into selection slices.

    granularity "model": one slice, the whole vector. "layer": one slice per parameter tensor,
    k split across them in proportion to their sizes.
    """

    def __init__(self, layer_sizes: list[int], granularity: str = "model"):
        if granularity not in ("model", "layer"):
            raise ValueError(f"granularity must be 'model' or 'layer', got {granularity!r}")
        self.layer_sizes = list(layer_sizes)
        self.numel = sum(layer_sizes)
        self.granularity = granularity
        if granularity == "model":
            self.slices = [(0, self.numel)]
        else:
            offsets = np.cumsum([0, *layer_sizes[:-1]])
            self.slices = [(int(o), int(s)) for o, s in zip(offsets, layer_sizes)]

    def slice_index(self, offset: int) -> int:
        """The index of the slice that starts at ``offset``."""
        for i, (o, _) in enumerate(self.slices):
            if o == offset:
                return i
        raise ValueError(f"no slice starts at offset {offset}")

    def split(self, k: int) -> list[int]:
        return [k] if len(self.slices) == 1 else split_k(k, [s for _, s in self.slices])


class SelectionPolicy:
    """Base class: plain top-k of |accumulator|. Subclass and override what differs."""

    name = "base"
    params: dict[str, Param] = {}
    two_phase = False
    # False: the policy has no device path (its rule reads values back every round), and a GPU
    # worker refuses it by name rather than synchronising with the device in every round
    device_path = True

    def __init__(self, layout: Layout, k: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, xp=np, dev=None, **params):
        self.layout, self.rank, self.world_size, self.seed = layout, rank, world_size, seed
        # dev: the device backend of a GPU worker (psparse.backends.cuda), else None; the policy
        # works through ``backend``, the device's or the host's (psparse.backends.host)
        self.dev = dev
        self.backend = dev or HostBackend(xp)
        if not isinstance(self.backend, HostBackend) and not self.device_path:
            raise PolicyError(f"policy {self.name!r} runs on the host path only (its threshold "
                              "controller reads counts back every round): use --device cpu")
        self.xp = self.backend.xp  # numpy, or cupy on the GPU
        self.engines = self.backend.engines(layout)  # selections, where the arrays are
        self.fusion: Fusion | None = None  # the round's error-feedback work (set by the session)
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise PolicyError(f"policy {self.name!r} has no parameter {unknown[0]!r}; valid: "
                              f"{', '.join(sorted(self.params)) or '(none)'}")
        for name, spec in self.params.items():
            if callable(getattr(type(self), name, None)):
                raise PolicyError(f"policy {self.name!r}: parameter {name!r} would hide the "
                                  "method of that name; rename the parameter")
            setattr(self, name, spec.convert(name, params.get(name, spec.default)))
        # the host's per-slice selectors (their scratch): the host engines' own
        self._selectors = getattr(self.engines, "selectors", None) or \
            [Selector(size) for _, size in layout.slices]
        self.live = list(range(world_size))  # ranks still in the run (fewer after an elastic loss)
        self.set_k(k)

    # ---------------------------------------------------------------------------- the hooks
    def set_k(self, k: int) -> None:
        """Entries to send per iteration (changes during density warm-up)."""
        self.k = min(k, self.layout.numel)
        self.slice_k = self.layout.split(self.k)

    def select(self, accumulator: np.ndarray, iteration: int,
               group: np.ndarray | None = None) -> np.ndarray:
        if self.device_native and self.engines.ranks_every_key:
            return self.select_device(accumulator, iteration, group)
        return self.per_slice(accumulator, self.slice_k, self.select_slice)

    # ------------------------------------------------------------------------ the device
    # On a GPU worker ``select`` runs ``select_device``: the radix engine ranks ``device_key``
    # in every slice at once (psparse/backends/device_engines.py), with no host round trip. A policy
    # that changes ``score`` or ``select_slice`` without saying how on the device keeps the
    # host-style path there (its own array code on the device's arrays). The host's engines
    # rank the keys |x| and the threshold's, not yet every policy's (``ranks_every_key``), so
    # on the host ``select`` takes the per-slice path (``score``, ``select_slice``).
    fuses_accumulation = True  # select_device's first pass reads the accumulator first

    def device_key(self, accumulator):
        """What the engine ranks on the device (``radix.Key``): by default |accumulator|."""
        return radix.Key(radix.KEY_ABS, accumulator)

    def select_device(self, accumulator, iteration: int, group=None):
        """The device selection: a ``DeviceSelection`` (or a device array of indices)."""
        return self.engines.select("select", self.device_key(accumulator), self.slice_k,
                                   self.fusion)

    device_graph: bool | None = None  # may the device selection be a CUDA graph (None: auto)

    @property
    def graph_safe(self) -> bool:
        """A one-phase round whose device selection is engine launches alone (the same every
        round at one budget), so it can be captured once and replayed (a CUDA graph)."""
        if self.device_graph is not None:
            return self.device_graph
        return not self.two_phase and type(self).select is SelectionPolicy.select and \
            self.device_native

    @property
    def device_native(self) -> bool:
        """True when this class's device path stands for its host path: no class below the
        one that defines ``device_key`` / ``select_device`` redefines ``score``,
        ``select_slice`` or ``select`` (a user's subclass of a built-in)."""
        for cls in type(self).__mro__:
            names = vars(cls)
            if "select_device" in names or "device_key" in names or cls is SelectionPolicy:
                return True
            if any(n in names for n in ("score", "select_slice", "select")):
                return False
        return True

    def per_slice(self, accumulator: np.ndarray, slice_k: list[int], choose) -> np.ndarray:
        """Apply ``choose(slice, k, offset)`` to every slice; sorted global indices."""
        parts = []
        for (offset, size), k in zip(self.layout.slices, slice_k):
            if k > 0:
                chosen = choose(accumulator[offset:offset + size], k, offset)
                parts.append(chosen + offset if offset else chosen)
        if len(parts) == 1:
            return parts[0]
        # a user's select_slice may answer with host arrays on the device too
        xp = np if parts and all(isinstance(p, np.ndarray) for p in parts) else self.xp
        return xp.concatenate(parts) if parts else xp.empty(0, dtype=xp.int64)

    def select_slice(self, acc: np.ndarray, k: int, offset: int) -> np.ndarray:
        """Sorted indices (relative to the slice) of the k entries to send from one slice."""
        return self.topk(self.score(acc, offset), k, offset)

    def score(self, acc: np.ndarray, offset: int) -> np.ndarray:
        """Per-entry priority for the slice starting at ``offset``; larger is sent first."""
        return acc

    def dense_warmup_refusal(self) -> str | None:
        """Why this policy's --dense-warmup would not send every entry, or None."""
        return dense_warmup_refusal(self.name, self.two_phase,
                                    type(self).select is not SelectionPolicy.select)

    def propose(self, accumulator: np.ndarray, iteration: int) -> np.ndarray | None:
        """Two-phase policies: indices this worker proposes to the group (None: nothing)."""
        return None

    @property
    def group_k(self) -> int:
        """Two-phase policies: how many proposed indices the group keeps."""
        return self.k

    @property
    def max_push(self) -> int:
        """The most indices ``select`` may return at the current k (the push cap the server
        enforces). Policies whose count varies per round (``threshold``) declare their cap here."""
        return self.group_k if self.two_phase else self.k

    @property
    def max_propose(self) -> int:
        """The most indices ``propose`` may return at the current k (0: one-phase policy)."""
        return self.k if self.two_phase else 0

    def set_live(self, ranks: list[int]) -> None:
        """The ranks still in the run (an elastic run lost some); identical on every worker."""
        self.live = list(ranks)

    def observe(self, indices: np.ndarray, values: np.ndarray, iteration: int) -> None:
        """The round's aggregate (identical on every worker): update shared state here."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            current = getattr(self, key)
            if hasattr(current, "shape"):  # a numpy or CuPy array: fill in place
                current[...] = self.xp.asarray(value)
            else:
                setattr(self, key, value)

    # --------------------------------------------------------------------------- utilities
    def topk(self, score: np.ndarray, k: int, offset: int = 0) -> np.ndarray:
        """Sorted indices of the k largest |score| in a slice (exact; deterministic)."""
        return self.engines.topk(score, k, offset)

    def topk_scored(self, score, k: int, offset: int, full) -> np.ndarray:
        """``topk`` of a score written by ``score(sl, out)`` (score[sl] into out), without an
        n-sized score on large slices (``Selector.topk_scored``); ``full``: n floats of scratch."""
        return self._selectors[self._slice_index(offset)].topk_scored(score, k, full)

    def _slice_index(self, offset: int) -> int:
        return self.layout.slice_index(offset)

    def state_digest(self) -> str:
        """Hash of the state: equal on all workers for policies whose state is shared."""
        h = hashlib.blake2b(digest_size=8)
        for key, value in sorted(self.state_dict().items()):
            h.update(key.encode())
            h.update(np.ascontiguousarray(self.host(value)).tobytes() if hasattr(value, "shape")
                     else repr(value).encode())
        return h.hexdigest()

    def host(self, array) -> np.ndarray:
        """A state array's values on the host (for checkpoints and digests, not rounds)."""
        return self.backend.read(array)

    def describe(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)}" for n in self.params)
        return f"{self.name}({args})" if args else self.name


class ScoredPolicy(SelectionPolicy):
    """A policy that ranks each slice by a score computed entry by entry (ema, penalty), never
    written whole on a large host slice. Its ``score_kind(acc, offset)`` names the compiled
    score (``Selector.scored``'s arguments: kind, aux, marks, p, q) the host selects by, and
    ``_scorer(acc, offset)`` the same score in numpy (a function writing score[sl] into out):
    the reference, used with ``PSPARSE_CPU_KERNELS=numpy``, on a non-float32 accumulator and by
    ``score``. ``_score`` is the n floats of scratch the reference writes into.
    ``compiled_selection`` is the policy's switch: False, its host selection runs the numpy way
    (as before the compiled kernels) also where they would take the arrays, because the compiled
    score was measured slower there (docs/notes/bench-select.md, "Host selection compiled")."""

    compiled_selection = True

    @functools.cached_property
    def _score(self):
        # made on first use: the device ranks its key and never writes the score
        return self.xp.empty(self.layout.numel, dtype=self.xp.float32)

    def select_slice(self, acc, k, offset):
        if self.compiled_selection and host_compiled(acc):
            selector = self._selectors[self._slice_index(offset)]
            return selector.scored(acc, k, *self.score_kind(acc, offset))
        return self.topk_scored(self._scorer(acc, offset), k, offset,
                                self._score[offset:offset + acc.size])

    def score(self, acc, offset):
        """The score the selection ranks by, written into the scratch (for inspection)."""
        out = self._score[offset:offset + acc.size]
        self._scorer(acc, offset)(slice(0, acc.size), out)
        return out

    def score_kind(self, acc, offset) -> tuple:
        raise NotImplementedError

    def _scorer(self, acc, offset):
        raise NotImplementedError


def check_output(policy: SelectionPolicy, indices, iteration: int, limit: int,
                 method: str = "select") -> None:
    """Refuse what a policy returned unless it is a valid index set: a 1-D integer array, at
    most ``limit`` entries, each in [0, numel), strictly increasing. The error names the policy
    class, the method, the iteration and the broken rule, before anything is sent."""
    where = f"policy {type(policy).__name__}.{method}() at iteration {iteration}"
    if not (hasattr(indices, "dtype") and hasattr(indices, "ndim")):
        raise PolicyError(f"{where} returned {type(indices).__name__}, expected an array of "
                          "integer indices")
    if indices.ndim != 1:
        raise PolicyError(f"{where} returned an array of shape {tuple(indices.shape)}, expected "
                          "a 1-D array of indices")
    if indices.dtype.kind not in "iu":
        raise PolicyError(f"{where} returned {indices.dtype} indices, expected integers")
    count = int(indices.size)
    if count > limit:
        raise PolicyError(f"{where} returned {count} indices, more than its budget of {limit}")
    if count == 0:
        return
    numel = policy.layout.numel
    low, high = int(indices.min()), int(indices.max())
    if low < 0:
        raise PolicyError(f"{where} returned index {low}: indices must be >= 0")
    if high >= numel:
        raise PolicyError(f"{where} returned index {high}: out of range [0, {numel})")
    if count > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise PolicyError(f"{where} returned indices that are not strictly increasing "
                          "(they must be sorted, without duplicates)")
