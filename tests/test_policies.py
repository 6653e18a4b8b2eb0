"""Selection policies: each rule pinned on crafted inputs, loading, parameters, state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psparse.ops.select.sparsify import split_k
from psparse.policies import (
    REGISTRY,
    Layout,
    PolicyError,
    SelectionPolicy,
    build_policy,
    parse_policy_args,
    policy_class,
)
from psparse.policies.memory import Memory, density_schedule


def make(name, k, sizes=(10,), granularity="model", rank=0, world=4, **params):
    return build_policy(name, [f"{a}={b}" for a, b in params.items()],
                        Layout(list(sizes), granularity), k, rank=rank, world_size=world, seed=7)


def arr(*values):
    return np.array(values, dtype=np.float32)


def test_topk_takes_largest_magnitudes():
    acc = arr(0.1, -5, 3, 0, 0.2, -4, 0, 0, 1, 0)
    assert make("topk", 3).select(acc, 0).tolist() == [1, 2, 5]


def test_randomk_is_shared_across_workers_and_changes_each_round():
    acc = np.zeros(1000, np.float32)
    a, b = make("randomk", 20, (1000,), rank=0), make("randomk", 20, (1000,), rank=3)
    first = a.select(acc, 5)
    assert first.size == 20 and np.all(np.diff(first) > 0)
    assert np.array_equal(first, b.select(acc, 5))  # same indices on every worker
    assert not np.array_equal(first, a.select(acc, 6))


def test_threshold_sends_everything_above_lambda_and_k_varies():
    acc = arr(0.5, -2, 0.99, 1.0, -1.5, 0, 0, 3, 0, 0)
    p = make("threshold", 3, lam=1.0)
    assert p.select(acc, 0).tolist() == [1, 3, 4, 7]
    assert make("threshold", 3, lam=10).select(acc, 0).size == 0


def test_frequency_prefers_recently_aggregated_candidates():
    acc = arr(9, 8, 7, 6, 5, 4, 0, 0, 0, 0)
    p = make("frequency", 2, c=2, gamma=0.5)   # candidates: 4 largest = {0, 1, 2, 3}
    assert p.select(acc, 0).tolist() == [0, 1]  # no history: magnitude decides
    p.observe(np.array([3, 5]), arr(1, 1), 0)    # the group used 3 and 5
    p.observe(np.array([2, 3]), arr(1, 1), 1)    # priority: 3 -> 1.5, 2 -> 1, 5 -> 0.5
    assert p.priority.values()[[2, 3, 5]].tolist() == [1.0, 1.5, 0.5]
    assert p.select(acc, 2).tolist() == [2, 3]   # 5 has history but is not a candidate


def test_ema_blends_magnitude_with_shared_priority():
    acc = arr(1.0, 0.5, 0.3, 0, 0, 0, 0, 0, 0, 0)
    p = make("ema", 1, beta=0.5, lam=4)
    assert p.select(acc, 0).tolist() == [0]
    p.observe(np.array([1, 2]), arr(2.0, -1.0), 0)  # priority 1 -> 1.0, 2 -> 0.5
    np.testing.assert_allclose(p.score(acc, 0)[:3], [1.0, 0.5 * (1 + 4), 0.3 * (1 + 2)])
    assert p.select(acc, 1).tolist() == [1]


@pytest.mark.parametrize("pi, expected", [(0.25, [1]), (0.6, [0])])
def test_penalty_scales_indices_absent_from_the_previous_aggregate(pi, expected):
    acc = arr(1.0, 0.5, 0.2, 0, 0, 0, 0, 0, 0, 0)
    p = make("penalty", 1, pi=pi)
    assert p.select(acc, 0).tolist() == [0]  # no previous aggregate: all penalised alike
    p.observe(np.array([1, 2]), arr(1, 1), 0)
    assert p.select(acc, 1).tolist() == expected  # 0.5 vs pi * 1.0


def test_cltk_leader_proposes_and_everyone_sends_the_group_indices():
    acc = arr(0, 5, 0, 4, 0, 3, 0, 0, 0, 1)
    leader, other = make("cltk", 2, rank=1), make("cltk", 2, rank=2)
    assert leader.two_phase
    assert leader.propose(acc, 5).tolist() == [1, 3]  # 5 mod 4 == 1
    assert other.propose(acc, 5) is None
    group = np.array([1, 3])
    assert other.select(acc, 5, group=group).tolist() == [1, 3]
    with pytest.raises(ValueError, match="two-phase"):
        other.select(acc, 5)


def test_core_shares_a_core_and_keeps_an_own_slice():
    a = make("core", 4, (20,), own=0.25, beta=0.5, rank=0)
    b = make("core", 4, (20,), own=0.25, beta=0.5, rank=1)
    acc_a = np.zeros(20, np.float32)
    acc_b = np.zeros(20, np.float32)
    acc_a[[0, 1, 2, 3, 19]] = [9, 8, 7, 6, 5]
    acc_b[[10, 11, 12, 13, 18]] = [9, 8, 7, 6, 5]
    # no history yet: every worker sends its own top-k
    assert a.select(acc_a, 0).tolist() == [0, 1, 2, 3]
    for p in (a, b):
        p.observe(np.array([5, 6, 7, 8, 9]), arr(5, 4, 3, 2, 1), 0)
    # core = 3 best by priority (5, 6, 7); own slice = 1 entry of each worker's own top
    assert a.select(acc_a, 1).tolist() == [0, 5, 6, 7]
    assert b.select(acc_b, 1).tolist() == [5, 6, 7, 10]
    assert a.state_digest() == b.state_digest()


@pytest.mark.parametrize("world", [2, 8, 16, 32])
def test_core_private_keeps_the_union_under_twice_k_at_any_n(world):
    # private=1: all own slices together take k, each worker's own is k / N (issue 18); the
    # union of N workers that disagree completely is then |core| + N * own * k < 2k
    k, n = 64, 4096
    workers = [make("core", k, (n,), private=1.0, rank=r, world=world) for r in range(world)]
    assert workers[0].own_share == pytest.approx(1 / world)
    rng = np.random.default_rng(world)
    for it in range(6):
        accs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        chosen = [w.select(a, it) for w, a in zip(workers, accs)]
        assert all(c.size == k for c in chosen)
        union = np.unique(np.concatenate(chosen))
        if it > 0:  # round 0 has no history, so no core: every worker sends its own top k
            assert union.size <= (1 + 1 - 1 / world) * k + world  # + own * k's rounding
        mean = np.mean([a[union] for a in accs], axis=0)
        for w in workers:
            w.observe(union, mean, it)
    if world >= 8:  # from the second round on a core exists, and every worker sends it
        assert np.intersect1d(chosen[0], chosen[1]).size >= k - 2 * round(k / world)
    # an elastic loss shrinks N: the survivors' own slices grow to keep the private total
    workers[0].set_live(list(range(world // 2)))
    assert workers[0].own_share == pytest.approx(2 / world)


@pytest.mark.parametrize("name", sorted(set(REGISTRY) - {"threshold", "cltk", "vote", "micro",
                                                         "exdyna"}))
def test_per_layer_granularity_splits_k_by_layer_size(name):
    sizes = [30, 100, 370]
    acc = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    p = make(name, 25, sizes, "layer")
    for it in range(3):
        chosen = p.select(acc, it)
        counts = [np.count_nonzero((chosen >= o) & (chosen < o + s))
                  for o, s in zip([0, 30, 130], sizes)]
        assert counts == split_k(25, sizes)
        assert np.all(np.diff(chosen) > 0)
        p.observe(chosen, acc[chosen], it)


@pytest.mark.parametrize("name", ["cltk", "vote"])
def test_per_layer_two_phase_proposals(name):
    p = make(name, 10, [50, 50], "layer", rank=0)
    acc = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    proposal = p.propose(acc, 0)
    assert np.count_nonzero(proposal < 50) == 5 and proposal.size == 10


def test_vote_proposes_its_top_entries_and_asks_the_group_to_keep_keep_k():
    acc = arr(0, 5, 0, -4, 0, 3, 0, 0, 0, 1)
    p = make("vote", 2, offer=1.5, keep=0.5, rank=3)
    assert p.two_phase and p.group_k == 1
    assert p.propose(acc, 0).tolist() == [1, 3, 5]  # 1.5 k = 3, every worker proposes
    assert p.select(acc, 0, group=np.array([3])).tolist() == [3]


def test_unknown_policy_and_parameters_name_the_valid_ones():
    with pytest.raises(PolicyError, match="unknown policy 'bogus'; registered: topk, randomk"):
        policy_class("bogus")
    with pytest.raises(PolicyError, match="no parameter 'alpha'; valid: beta, lam"):
        make("ema", 2, alpha=1)
    with pytest.raises(PolicyError, match="pi=2.0: must be in \\(0, 1\\]"):
        make("penalty", 2, pi=2)
    with pytest.raises(PolicyError, match="expected float"):
        make("penalty", 2, pi="high")
    with pytest.raises(PolicyError, match="expected key=value"):
        parse_policy_args(["pi"])
    with pytest.raises(PolicyError, match="cannot import the policy's module"):
        policy_class("no_such_module_xyz:Policy")
    with pytest.raises(PolicyError, match="not a SelectionPolicy subclass"):
        policy_class("numpy:ndarray")


def test_user_policy_class_by_module_path():
    cls = policy_class("user_policy:LowestIndices")
    assert issubclass(cls, SelectionPolicy)
    p = build_policy("user_policy:LowestIndices", ["stride=2"], Layout([10]), 3)
    assert p.select(np.ones(10, np.float32), 0).tolist() == [0, 2, 4]


def test_state_dict_round_trip():
    a, b = make("core", 3, (50,)), make("core", 3, (50,))
    a.observe(np.array([1, 7]), arr(1, -2), 0)
    assert a.state_digest() != b.state_digest()
    b.load_state_dict(a.state_dict())
    assert a.state_digest() == b.state_digest()
    c = make("penalty", 3, (50,))
    c.observe(np.array([4, 9]), arr(1, 1), 0)
    d = make("penalty", 3, (50,))
    d.load_state_dict(c.state_dict())
    assert d.previous.indices.tolist() == [4, 9]


def test_dgc_memory_momentum_correction_and_masking():
    m = Memory(4, "dgc", momentum=0.5)
    g = arr(1, 2, 3, 4)
    m.add(g)                         # u = g, acc = g
    assert m.take(np.array([3])).tolist() == [4.0]
    m.add(g)                         # u = 0.5 u + g (u[3] masked to 0), acc += u
    np.testing.assert_allclose(m.accumulator, [2.5, 5, 7.5, 4])
    np.testing.assert_allclose(m.velocity, [1.5, 3, 4.5, 4])
    assert not m.optimizer_momentum_applies


def test_residual_memory_and_clipping():
    m = Memory(2, "residual", clip_norm=1.0)
    m.add(arr(3, 4))                 # norm 5 -> scaled to norm 1
    np.testing.assert_allclose(m.accumulator, [0.6, 0.8], rtol=1e-6)
    assert m.take(np.array([0])).tolist() == pytest.approx([0.6])
    assert m.accumulator[0] == 0 and m.optimizer_momentum_applies


def test_density_warmup_schedule():
    assert [density_schedule(0.001, 4, e) for e in (0, 1, 2, 3, 4)] == \
        [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    assert density_schedule(0.01, 4, 3.5) == 0.01  # never below the target
    assert density_schedule(0.01, 0, 0) == 0.01


def test_the_density_warmup_is_named_for_the_schedule_it_is():
    """The DGC paper's four-fold schedule, not DGC's released code's geometric interpolation
    d^((e+1)/(E+1)), which the docs give beside it (issue 51, item 10): the two differ."""
    from pathlib import Path

    from psparse.config import HELP

    dgc_code = [0.001 ** ((e + 1) / 5) for e in range(4)]  # E = 4 warm-up epochs, d = 0.1%
    ours = [density_schedule(0.001, 4, e) for e in range(4)]
    assert ours == [0.25 ** (e + 1) for e in range(4)] and ours != pytest.approx(dgc_code)
    assert "the DGC paper's four-fold schedule (not its released code's" in HELP["density_warmup"]
    docs = Path(__file__).resolve().parent.parent / "docs"
    assert "DGC warm-up:" not in (docs / "cli.md").read_text()
    assert "d^((e+1)/(E+1))" in (docs / "policies.md").read_text()


# ------------------------------------------------------------------ real multi-worker runs

def _run(tmp_path, name, *args):
    import json
    import os

    from conftest import read_jsonl, run_launch

    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    r = run_launch("--out", str(out), "--quiet",
                   "--workers", "3", "--model", "mlp", "--dataset", "digits",
                   "--iterations", "30", *args, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((out / f"rank-{i}.json").read_text()) for i in range(3)]
    return read_jsonl(out / "metrics.jsonl"), ranks


@pytest.mark.parametrize("policy", ["core", "penalty", "frequency", "ema"])
def test_policy_state_is_identical_on_all_workers_after_a_real_run(tmp_path, policy):
    metrics, ranks = _run(tmp_path, policy, "--policy", policy)
    digests = {r["policy_state"] for r in ranks}
    empty = SelectionPolicy(Layout([1]), 1).state_digest()
    assert len(digests) == 1 and empty not in digests
    assert all(r["policy"].startswith(policy) for r in ranks)
    assert len(metrics) == 30


def test_cltk_run_has_union_k_and_counts_the_proposal_round(tmp_path):
    metrics, ranks = _run(tmp_path, "cltk", "--policy", "cltk")
    k = ranks[0]["k"]
    assert all(m["union"] == k and m["proposed"] == k for m in metrics)
    # the index broadcast is on the bill: each worker received k indices twice per round
    assert all(m["broadcast_bytes"] > 3 * k * 8 + 3 * k * 4 for m in metrics)
    assert sum(m["upload_bytes"] for m in metrics) == sum(r["push_bytes"] for r in ranks)


def test_user_policy_through_the_command_line(tmp_path):
    metrics, ranks = _run(tmp_path, "user", "--policy", "user_policy:LowestIndices",
                          "--policy-arg", "stride=3")
    assert ranks[0]["policy"] == "lowest(stride=3)"
    k = ranks[0]["k"]
    assert all(m["union"] == k for m in metrics)  # every worker sends the same indices


def test_unknown_policy_is_refused_before_anything_starts(tmp_path):
    from conftest import run_launch

    r = run_launch("--out", str(tmp_path / "x"),
                   "--policy", "ema", "--policy-arg", "gamma=3", timeout=60)
    assert r.returncode == 2 and "no parameter 'gamma'; valid: beta, lam" in r.stderr
    assert not (tmp_path / "x").exists()


def test_the_documented_user_policy_works(tmp_path, monkeypatch):
    """docs/policies.md's 30-line example, extracted and loaded like a user would."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "policies.md").read_text()
    code = doc.split("### A complete user policy")[1].split("```python\n")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 30
    (tmp_path / "sticky.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    p = build_policy("sticky:Sticky", ["bonus=3"], Layout([10]), 2)
    acc = arr(5, 0, 2, 0, 0, 0, 0, 0, 0, 1)
    assert p.select(acc, 0).tolist() == [0, 2]
    p.observe(np.array([9]), arr(1), 0)
    assert p.select(acc, 1).tolist() == [0, 9]  # 1 x 3 beats 2
