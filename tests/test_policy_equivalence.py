"""Every built-in policy selects exactly what its straightforward version selects (issue 18,
item 3: selection made fast without changing what is selected).

Each policy runs side by side with its reference (``tests/policy_reference.py``: the policies
as they were, top-k by a full lexsort) over many rounds of error feedback, with ties (values on
a coarse grid, runs of equal values, zeros; rounds with fewer nonzero entries than k),
aggregates that push the shared state into float32's subnormal range and down to zero, budget
changes (down, as in a density warm-up, and up), a checkpoint restore into a fresh instance, and
both selection paths (exact partition, and the sampled
threshold used above ``EXACT_BELOW``). Indices must be equal every round; the state (its digest,
which hashes the bytes) equal at every restore and at the end.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
from policy_reference import REFERENCES

from psparse.backends import host as host_backend
from psparse.ops import jit
from psparse.ops.feedback import updates
from psparse.ops.select import selection, sparsify
from psparse.ops.select.selection import sorted_union
from psparse.ops.select.sparsify import Selector
from psparse.policies import REGISTRY, Layout, base, build_policy, ema, frequency

MODEL = [7037]
LAYERS = [5000, 37, 1200, 1, 799]

CASES = [  # (policy, args)
    ("topk", {}), ("randomk", {}), ("threshold", {"lam": "0.75"}),
    ("threshold", {"lam": "0.5", "cap": "1.5"}), ("frequency", {}),
    ("frequency", {"c": "1", "gamma": "0.5"}), ("ema", {}), ("ema", {"lam": "0", "beta": "0"}),
    ("penalty", {}), ("penalty", {"pi": "1"}), ("cltk", {}), ("core", {}),
    ("core", {"signed": "true", "beta": "0.9"}), ("core", {"own": "0"}), ("core", {"own": "1"}),
    ("vote", {}), ("vote", {"keep": "1.5", "offer": "2"}),
    ("micro", {}), ("micro", {"init": "2", "cap": "2"}), ("exdyna", {"init": "2"}),
    ("exdyna", {"blocks": "100", "align": "1", "cap": "8"}),
]
WHOLE_MODEL_ONLY = ("micro", "exdyna")  # they partition the flat vector: layers are refused


def test_every_built_in_policy_has_a_reference():
    assert set(REFERENCES) == set(REGISTRY)
    assert {name for name, _ in CASES} == set(REGISTRY)


def build(cls_or_name, layout, k, args, rank=0):
    if isinstance(cls_or_name, str):
        return build_policy(cls_or_name, [f"{a}={v}" for a, v in args.items()], layout, k,
                            rank=rank, world_size=4, seed=3)
    return cls_or_name(layout, k, rank=rank, world_size=4, seed=3, **args)


def gradient(rng, n, it):
    """Heavy-tailed, on a grid of 1/8 (so many exact ties), with zeros and runs of equal values."""
    g = rng.standard_normal(n) * np.abs(rng.standard_normal(n)) ** 3
    g = np.round(g * 8) / 8
    if it % 3 == 0:
        start = rng.integers(0, n - 60)
        g[start:start + 50] = 2.5  # a run of ties at a large magnitude
    if it % 5 == 1:
        g[rng.integers(0, n, n // 4)] = 0.0
    return g.astype(np.float32)


def aggregate(rng, n, pushed, it):
    """This worker's push plus three others'; values of every size, some subnormal-bound."""
    others = [np.sort(rng.choice(n, rng.integers(1, 200), replace=False)) for _ in range(3)]
    indices = sorted_union([pushed.astype(np.int64), *others])
    values = (rng.standard_normal(indices.size) * 2).astype(np.float32)
    kind = it % 4
    if kind == 1:
        values *= np.float32(1e-36)  # these decay into subnormals within a few rounds
    elif kind == 2:
        values[::3] = 0.0
    elif kind == 3:
        values = np.round(values).astype(np.float32)  # equal priorities
    return indices, values


def group_for(rng, policy, proposals, n, it):
    """The server's answer in a two-phase round (its rule does not matter here)."""
    if policy.name == "cltk":
        if proposals is not None:
            return proposals
        return np.sort(rng.choice(n, policy.k, replace=False)).astype(np.int64)
    offered = sorted_union([proposals, np.sort(rng.choice(n, 300, replace=False))])
    keep = min(offered.size, policy.group_k)
    return np.sort(rng.choice(offered, keep, replace=False)).astype(np.int64)


# A lazily decayed state (``updates.Decaying``: core, ema, frequency) is rounded once per add
# where the reference rounds once per round as well: after 48 rounds of two roundings of at most
# 2^-24 each, a relative difference below 6e-6 (3x margin). Values that decayed below float32's
# smallest normal are flushed to 0 at a renormalisation (the reference keeps subnormals). A
# signed EMA (core signed=true) cancels, so its error is relative to the terms added, which are
# at most its largest magnitude, not to the result: there the tolerance is absolute.
STATE_RTOL = 2e-5


def assert_same_state(fast, ref):
    """Bit-identical state; a ``Decaying`` priority equal within STATE_RTOL (or tiny)."""
    if isinstance(getattr(fast, "priority", None), updates.Decaying):
        atol = STATE_RTOL * float(np.abs(ref.priority).max()) if getattr(fast, "signed", False) \
            else np.finfo(np.float32).tiny
        np.testing.assert_allclose(fast.priority.values(), ref.priority, rtol=STATE_RTOL,
                                   atol=atol)
    else:
        assert fast.state_digest() == ref.state_digest()


def run_side_by_side(name, args, sizes, granularity, rounds=48, k=70, seed=0):
    """``fast`` against its reference; from the middle on, ``fast`` is a fresh policy restored
    from the checkpoint of ``whole``, which runs on uninterrupted: they must stay bit-identical
    (selections and state digests)."""
    layout = Layout(sizes, granularity)
    n = layout.numel
    fast = build(name, layout, k, args)
    ref = build(REFERENCES[name], layout, k, args)
    whole = None
    rng = np.random.default_rng(seed)
    acc = np.zeros(n, np.float32)
    for it in range(rounds):
        policies = [p for p in (fast, ref, whole) if p is not None]
        if it in (rounds // 3, 3 * rounds // 4):  # the budget changes, down and up again
            budget = k // 2 if it == rounds // 3 else 2 * k
            for p in policies:
                p.set_k(budget)
        if it == rounds // 2:  # a checkpoint restored into a fresh policy
            assert_same_state(fast, ref)
            whole, fast = fast, build(name, layout, fast.k, args)
            fast.load_state_dict(whole.state_dict())
            assert fast.state_digest() == whole.state_digest()
            policies = [fast, ref, whole]
            if name == "cltk":
                for p in policies:
                    p.set_live([0, 2, 3])
        acc += gradient(rng, n, it)
        if it % 11 == 5:  # a nearly empty accumulator: fewer nonzero entries than k
            acc[rng.random(n) > 20 / n] = 0.0
        group = None
        if fast.two_phase:
            proposal = fast.propose(acc, it)
            expected = ref.propose(acc, it)
            assert (proposal is None) == (expected is None)
            if proposal is not None:
                np.testing.assert_array_equal(proposal, expected, err_msg=f"propose {it}")
            if whole is not None and proposal is not None:
                np.testing.assert_array_equal(proposal, whole.propose(acc, it))
            group = group_for(rng, fast, proposal, n, it)
        chosen = fast.select(acc, it, group=group)
        np.testing.assert_array_equal(chosen, ref.select(acc, it, group=group),
                                      err_msg=f"{name} {args} round {it}")
        if whole is not None:
            np.testing.assert_array_equal(chosen, whole.select(acc, it, group=group),
                                          err_msg=f"restored {name} {args} round {it}")
        assert chosen.dtype.kind == "i"
        acc[chosen] = 0.0  # error feedback
        indices, values = aggregate(rng, n, chosen, it)
        for p in policies:
            p.observe(indices, values, it)
    assert_same_state(fast, ref)
    assert fast.state_digest() == whole.state_digest()
    return fast, ref


@pytest.fixture(params=["exact", "sampled", "compiled"])
def selection_path(request, monkeypatch):
    """'compiled': the host's compiled kernels (psparse/ops/select/select_kernels.py); the others their
    numpy references (PSPARSE_CPU_KERNELS=numpy). 'sampled': slices from 1024 entries up take
    the sampled-threshold path (as above 1M), and the block-by-block passes (selection,
    threshold) run on 1000-entry blocks, so the tests' 7037 entries span several blocks as
    11M entries do."""
    monkeypatch.setattr(jit, "REFERENCE", request.param != "compiled")
    if request.param == "compiled":
        # numba loaded: jit.compiled's small-call rule then runs the kernels at 7037 entries
        importlib.import_module("psparse.ops.select.select_kernels")
    if request.param == "sampled":
        # the host's selectors are made by its engines (psparse.backends.host)
        monkeypatch.setattr(host_backend, "Selector", functools.partial(Selector,
                                                                        exact_below=1024))
        monkeypatch.setattr(sparsify, "BLOCK", 1000)
    return request.param


@pytest.fixture(params=["renormalise-rarely", "renormalise-often"])
def renormalisation(request, monkeypatch):
    """'often': a lazily decayed state renormalises (rescales, flushes) every few rounds, e.g.
    every 3rd at beta = 0.5, every 20th at 0.9 (ema: whenever its stored maximum passes 4), so
    also across the restore; by default (every 65th at beta = 0.5) the 48 rounds see none,
    except at beta = 0."""
    if request.param == "renormalise-often":
        monkeypatch.setattr(updates.Decaying, "RENORMALISE_BELOW", 2.0 ** -3)
        monkeypatch.setattr(ema, "STORED_LIMIT", 4.0)
    return request.param


@pytest.mark.parametrize("granularity", ["model", "layer"])
@pytest.mark.parametrize("name, args", CASES,
                         ids=[f"{n}-" + ",".join(f"{a}={v}" for a, v in a.items())
                              for n, a in CASES])
def test_policy_selects_what_its_reference_selects(name, args, granularity, selection_path,
                                                   renormalisation):
    sizes = MODEL if granularity == "model" else LAYERS
    if granularity == "layer" and name in WHOLE_MODEL_ONLY:
        with pytest.raises(base.PolicyError, match="partitions the whole flat parameter vector"):
            build(name, Layout(sizes, granularity), 70, args)
        return
    policy, _ = run_side_by_side(name, args, sizes, granularity)
    if selection_path == "sampled":
        assert any(not s.exact for s in policy._selectors)


def test_state_reaches_subnormals():
    """The inputs do what the module docstring says: the reference's decayed state holds
    subnormal values (the lazy state's stored values, scaled up, do not)."""
    _, ref = run_side_by_side("core", {}, MODEL, "model", rounds=48)
    p = ref.state_dict()["priority"]
    assert np.count_nonzero((p > 0) & (p < np.finfo(np.float32).tiny)) > 0


def test_core_searches_again_when_its_candidates_cannot_hold_the_core():
    """core's candidates are the entries at or above its last core's smallest priority (and those
    aggregated up to it since); a larger budget then needs the whole slice searched again."""
    fast, ref = (build(c, Layout([200]), 4, {"own": "0"}) for c in ("core", REFERENCES["core"]))
    acc = np.arange(200, dtype=np.float32)
    indices = np.arange(0, 200, 5)
    values = np.linspace(1, 2, indices.size, dtype=np.float32)
    for it, budget in enumerate([4, 4, 16, 40, 3]):
        for p in (fast, ref):
            p.set_k(budget)
        chosen = fast.select(acc, it)
        np.testing.assert_array_equal(chosen, ref.select(acc, it))
        assert chosen.size == budget
        if it == 2:  # at most 4 + 2 candidates (the last core, 2 aggregated since) cannot hold
            # a core of 16: all 40 nonzero entries searched, the 16 at or above the 16th kept
            assert fast._candidates[0].size == 16
        for p in (fast, ref):  # 40 indices, then only 2: the others are not aggregated
            p.observe(indices if it == 0 else indices[[3, 9]], values[:40 if it == 0 else 2],
                      it)
    assert_same_state(fast, ref)


def test_core_with_fewer_nonzero_priorities_than_its_core():
    """Fewer nonzero priorities than core_k, and aggregated entries whose priority stays 0:
    the core is the nonzero ones only, as the reference's."""
    fast, ref = (build(c, Layout([50]), 10, {"own": "0"}) for c in ("core", REFERENCES["core"]))
    acc = np.linspace(1, 2, 50, dtype=np.float32)
    rounds = [(np.arange(6), [1, 2, 0, 0, 3, 0]), (np.arange(10, 30), [0] * 20),
              (np.arange(30, 45), [1] * 15), (np.arange(0, 50, 7), [0] * 8)]
    for it, (indices, values) in enumerate(rounds):
        chosen = fast.select(acc, it)
        np.testing.assert_array_equal(chosen, ref.select(acc, it), err_msg=f"round {it}")
        for p in (fast, ref):
            p.observe(indices, np.array(values, np.float32), it)
    assert_same_state(fast, ref)


def test_state_updates_equal_the_plain_expressions():
    """decay_and_add / decay_and_count (numpy.add.at) against fancy-index +=, subnormals in."""
    rng = np.random.default_rng(4)
    n = 200_017
    state = (rng.standard_normal(n) * 1e-37).astype(np.float32)  # some decay into subnormals
    state[::5] = 0.0
    indices = rng.permutation(rng.choice(n, 5000, replace=False))
    values = rng.standard_normal(indices.size).astype(np.float32)
    for magnitude in (True, False):
        got, want = state.copy(), state.copy()
        out = np.empty(indices.size, np.float32)
        updates.decay_and_add(got, indices, values, 0.9, 0.1, magnitude=magnitude, out=out)
        want *= np.float32(0.9)
        want[indices] += np.float32(0.1) * (np.abs(values) if magnitude else values)
        assert got.tobytes() == want.tobytes()
        assert out.tobytes() == want[indices].tobytes()
    got, want = state.copy(), state.copy()
    updates.decay_and_count(got, indices, 0.5)
    want *= np.float32(0.5)
    want[indices] += np.float32(1.0)
    assert got.tobytes() == want.tobytes()


def test_lazy_decay_equals_the_eager_update():
    """``updates.Decaying`` against decaying every entry every round: bit-identical for a
    power-of-two decay while values stay normal, within rounding otherwise; a renormalisation
    flushes what fell below float32's smallest normal; a restored copy continues bit-identically;
    a plain (eager) state loads as its values."""
    rng = np.random.default_rng(5)
    n, tiny = 5000, np.finfo(np.float32).tiny
    for decay, exact in ((0.5, True), (0.9, False)):
        lazy, eager, copy = updates.Decaying(n), np.zeros(n, np.float32), None
        for it in range(150):  # 0.5: renormalises at rounds 64 and 128
            indices = np.sort(rng.choice(n, 300, replace=False))
            values = rng.standard_normal(300).astype(np.float32)
            if it == 40:
                copy = updates.Decaying(n)
                copy.load_state_dict(lazy.state_dict())
            for state in (lazy, copy):
                if state is not None:
                    state.decay(decay)
                    state.add(indices, values, 1 - decay)
            updates.decay_and_add(eager, indices, values, decay, 1 - decay)
        got = lazy.values()
        normal = eager >= tiny
        if exact:
            assert got[normal].tobytes() == eager[normal].tobytes()
        np.testing.assert_allclose(got, eager, rtol=1e-5, atol=tiny)
        assert not np.any((lazy.stored != 0) & (np.abs(lazy.stored) < tiny))
        assert copy.stored.tobytes() == lazy.stored.tobytes()
        assert copy.scale == lazy.scale
    plain = updates.Decaying(n)
    plain.load_state_dict({"priority": eager})
    assert plain.scale == 1.0 and plain.values().tobytes() == eager.tobytes()


def test_renormalisation_flushes_below_the_smallest_normal():
    state = updates.Decaying(4)
    state.add(np.arange(4), np.array([1e-10, 1e-20, -1e-20, 0.0], np.float32), 1.0,
              magnitude=False)
    for _ in range(65):  # the scale 2^-65 is below 2^-64: stored *= 2^-65, scale = 1
        state.decay(0.5)
    assert state.scale == 1.0
    assert state.stored[0] == np.float32(1e-10) * np.float32(2.0 ** -65)  # 2.7e-30: kept
    assert state.stored[1:].tolist() == [0.0, 0.0, 0.0]  # +-2.7e-40, subnormal: flushed


@pytest.mark.parametrize("path", ["numpy", "compiled"])
def test_frequency_streams_a_large_pool(monkeypatch, path):
    """frequency on a large slice with a large pool: one pass with sampled bounds (the pool's
    edge within a few percent, a key the k-th best reaches) answers as the reference does,
    with ties at the edge (the gradient's 1/8 grid), first with counts mostly zero (the key is a
    magnitude), then with most entries counted (the key is a count). "numpy": the streamed
    numpy pass (the compiled kernel's oracle); "compiled": select_kernels.frequency_top_k, which
    the policy runs only where it does not stream (STREAM_ABOVE raised here so it takes this
    pool)."""
    monkeypatch.setattr(jit, "REFERENCE", path == "numpy")
    if path == "compiled":
        monkeypatch.setattr(frequency, "STREAM_ABOVE", 1.0)
    monkeypatch.setattr(host_backend, "Selector", functools.partial(Selector, exact_below=1024))
    monkeypatch.setattr(sparsify, "BLOCK", 30_000)
    n, k = 300_000, 3000
    fast, ref = (build(c, Layout([n]), k, {}) for c in ("frequency", REFERENCES["frequency"]))
    answered = []
    streamed = fast._streamed
    monkeypatch.setattr(fast, "_streamed",
                        lambda *a: answered.append(streamed(*a)) or answered[-1])
    rng = np.random.default_rng(2)
    acc = np.zeros(n, np.float32)
    for it in range(12):
        acc += gradient(rng, n, it)
        chosen = fast.select(acc, it)
        np.testing.assert_array_equal(chosen, ref.select(acc, it), err_msg=f"round {it}")
        acc[chosen] = 0.0
        others = np.sort(rng.choice(n, 300 if it < 6 else n // 3, replace=False))
        indices = sorted_union([chosen, others])
        for p in (fast, ref):
            p.observe(indices, np.ones(indices.size, np.float32), it)
    if path == "numpy":  # the pass answered, not the fallback
        assert sum(a is not None for a in answered) >= 10
    else:  # the compiled call answered: the numpy stream never ran
        assert not answered
    assert_same_state(fast, ref)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_frequency_refuses_a_non_finite_accumulator(bad):
    """frequency's small-slice path checks only the pool's magnitudes: argpartition orders NaN
    and inf above every number, so one anywhere (or more of them than the pool holds) is in
    the pool and refused, as top-k refuses it."""
    n, k = 7037, 70
    policy = build("frequency", Layout([n]), k, {})
    for where in (0, 3000, n - 1, slice(0, 1000)):
        acc = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        acc[where] = bad
        with pytest.raises(selection.NonFiniteError):
            policy.select(acc, 0)
