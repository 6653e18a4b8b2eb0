"""micro and exdyna: every worker chooses only inside its own partition of the model this round.

Unit level: several ranks built alike and fed the same observe() stream (as the runtime feeds
identical aggregates) propose disjoint index sets whose partitions cover the model, every round
and after an elastic loss; the threshold and rebalancing rules on crafted counts. Real runs:
4 workers, the server keeps every proposal (union == distinct proposed) and every worker pushes
the union, density within the stated range, the same policy state on every rank (resume:
tests/test_resume.py; --servers: tests/test_shards.py; an elastic run: here, with
test_liveness's helpers).
"""

from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest
from conftest import read_jsonl, run_launch
from test_liveness import cleanup, start

from psparse.policies import Layout, PolicyError, build_policy

SIZES = [3000, 1234, 7]  # numel 4241: neither L nor the blocks divide it


def group(name, world, k=40, sizes=SIZES, **params):
    layout = Layout(list(sizes))
    return [build_policy(name, [f"{a}={b}" for a, b in params.items()], layout, k, rank=r,
                         world_size=world) for r in range(world)]


def one_round(workers, accs, it, live):
    """Each live rank proposes from its accumulator; the group is the union of the proposals;
    every rank pushes there; all observe the mean of every rank's accumulator at the union."""
    chosen = {r: workers[r].propose(accs[r], it) for r in live}
    union = np.unique(np.concatenate(list(chosen.values())))
    assert all(np.array_equal(workers[r].select(accs[r], it, group=union), union) for r in live)
    mean = np.mean([accs[r][union] for r in live], axis=0).astype(np.float32)
    for r in live:
        workers[r].observe(union, mean, it)
    return chosen, union


def check_partitions(workers, live, it, numel):
    edges = [workers[r].edges() for r in live]
    assert all(np.array_equal(e, edges[0]) for e in edges)  # the same cut on every rank
    e = edges[0]
    assert e.size == len(live) + 1 and e[0] == 0 and e[-1] == numel and np.all(np.diff(e) > 0)
    owned = sorted(workers[r].owned(it) for r in live)
    assert owned == list(range(len(live)))  # each partition has exactly one owner
    return e


# init 2.5: about 1% of the quiet entries and half of the busy ones pass; cap: none binds
@pytest.mark.parametrize("name, params", [("micro", {"init": 2.5, "cap": 40}),
                                          ("exdyna", {"init": 2.5, "cap": 40, "blocks": 64})])
def test_proposals_are_disjoint_and_partitions_cover_the_model_every_round(name, params):
    world, numel = 4, sum(SIZES)
    workers = group(name, world, **params)
    rng = np.random.default_rng(3)
    scale = np.ones(numel, np.float32)
    scale[:500] = 4.0  # one region much busier than the rest: exdyna shrinks its partition
    live = list(range(world))
    for it in range(40):
        if it == 25:  # an elastic loss: the survivors cut the model among themselves
            live = [0, 1, 3]
            for r in live:
                workers[r].set_live(live)
        accs = [rng.standard_normal(numel).astype(np.float32) * scale for _ in range(world)]
        e = check_partitions(workers, live, it, numel)  # the cut this round selects in
        chosen, union = one_round(workers, accs, it, live)
        assert union.size == sum(c.size for c in chosen.values())  # disjoint
        for r in live:  # inside its own partition, sorted, within the push cap
            c = chosen[r]
            j = workers[r].owned(it)
            assert c.size <= workers[r].max_propose and np.all(np.diff(c) > 0)
            assert c.size == 0 or (e[j] <= c[0] and c[-1] < e[j + 1])
        states = {workers[r].state_digest() for r in live}
        assert len(states) == 1  # the threshold (and exdyna's cut) shared
    if name == "exdyna":
        assert workers[0].parts.size == 3
        assert not np.array_equal(workers[0].parts, workers[0].equal_parts())  # rebalanced


def test_micro_partitions_are_equal_and_rotate_with_the_iteration():
    workers = group("micro", 4)
    assert workers[0].edges().tolist() == [0, 1061, 2121, 3181, 4241]  # 4241 = 4 x 1060 + 1
    assert [w.owned(0) for w in workers] == [0, 1, 2, 3]
    assert [w.owned(5) for w in workers] == [1, 2, 3, 0]


def test_the_threshold_starts_at_the_papers_value_and_follows_the_count():
    (p,) = group("micro", 1, k=100)
    p.propose(np.zeros(sum(SIZES), np.float32), 0)
    assert p.threshold == 1 / (2 * math.sqrt(100))
    expected = p.threshold
    for sent, factor in [(111, 1.005), (110, 1.00125), (91, 1.00125), (90, 0.995), (0, 0.995)]:
        p.observe(np.arange(sent), np.ones(sent, np.float32), 1)
        expected *= factor
        assert p.threshold == expected, sent
    (q,) = group("micro", 1, k=100, init=0.5)
    q.propose(np.zeros(sum(SIZES), np.float32), 0)
    assert q.threshold == 0.5


@pytest.mark.parametrize("name, params", [("micro", {}), ("exdyna", {"blocks": 64})])
def test_on_a_steady_gradient_the_threshold_holds_the_density_within_10_percent(name, params):
    # fresh N(0, 1) accumulators every round: the target threshold is fixed (about 1.67 for
    # k = 400 of 4241), so the controller must reach it from init and then stay in its band
    workers = group(name, 4, k=400, init=1.0, **params)
    rng = np.random.default_rng(1)
    ratios = []
    for it in range(600):
        accs = [rng.standard_normal(sum(SIZES)).astype(np.float32) for _ in range(4)]
        _, union = one_round(workers, accs, it, range(4))
        ratios.append(union.size / 400)
    assert abs(np.mean(ratios[200:]) - 1) < 0.10, np.mean(ratios[200:])
    assert 0.5 < min(ratios[200:]) and max(ratios[200:]) < 1.5


def test_a_dense_aggregate_counts_its_nonzero_entries():
    (p,) = group("micro", 1, k=100, init=1.0)
    p.propose(np.zeros(sum(SIZES), np.float32), 0)
    values = np.zeros(sum(SIZES), np.float32)
    values[:95] = 1.0  # 95 sent in a dense aggregate of every index: within the band
    p.observe(np.arange(values.size), values, 0)
    assert p.threshold == 1.00125


def test_over_the_cap_the_largest_are_proposed_and_the_group_keeps_all():
    (p,) = group("micro", 2, k=10, init=0.1, cap=1.0)[:1]  # cap: 1 x 10 / 2 = 5 per worker
    acc = np.zeros(sum(SIZES), np.float32)
    acc[:8] = [1, -9, 2, 8, -3, 7, 0.5, 6]  # partition 0: eight over the threshold
    assert (p.max_propose, p.group_k, p.max_push) == (5, 10, 10)
    assert p.propose(acc, 0).tolist() == [1, 3, 4, 5, 7]
    with pytest.raises(ValueError, match="needs the group's indices"):
        p.select(acc, 0)


def test_exdyna_blocks_and_the_leftover():
    (p,) = group("exdyna", 1, blocks=64, sizes=[64 * 40 + 5])
    assert (p.block_size, p.leftover) == (32, 64 * 8 + 5)  # 40 rounded down to 32
    (q,) = group("exdyna", 1, blocks=64, sizes=[64 * 20 + 5])
    assert (q.block_size, q.leftover) == (20, 5)  # under 32: not rounded


@pytest.mark.parametrize("counts, parts, expected", [
    ([200, 50, 100, 50], [16, 16, 16, 16], [15, 17, 16, 16]),   # 0 -> 1
    ([100, 100, 40, 160], [16, 16, 16, 16], [16, 16, 17, 15]),  # 3 -> 2
    ([300, 20, 40, 40], [4, 28, 16, 16], [4, 28, 16, 16]),      # 0 is at its floor (4)
    ([104, 96, 100, 100], [16, 16, 16, 16], [16, 16, 16, 16]),  # within 1.05
])
def test_exdyna_moves_one_block_between_unbalanced_neighbours(counts, parts, expected):
    (p,) = group("exdyna", 4, blocks=64, sizes=[64 * 32])[:1]
    p.parts = np.array(parts, np.int64)
    p.rebalance(np.array(counts, np.int64))
    assert p.parts.tolist() == expected


def test_exdyna_reads_the_counts_per_partition_from_the_aggregate():
    workers = group("exdyna", 4, blocks=64, sizes=[64 * 32])
    sent = np.concatenate([np.arange(0, 200), np.arange(512, 562), np.arange(1024, 1124),
                           np.arange(1536, 1586)])  # 200, 50, 100, 50 per partition
    for w in workers:
        w.propose(np.zeros(64 * 32, np.float32), 0)
        w.observe(sent, np.ones(sent.size, np.float32), 0)
    assert all(w.parts.tolist() == [15, 17, 16, 16] for w in workers)


def test_state_round_trips_so_a_resumed_worker_selects_the_same():
    a = group("exdyna", 2, blocks=64)[0]
    rng = np.random.default_rng(0)
    for it in range(5):
        acc = rng.standard_normal(sum(SIZES)).astype(np.float32)
        chosen = a.propose(acc, it)
        a.observe(chosen, acc[chosen] + np.float32(3) * (chosen < 800), it)
    b = group("exdyna", 2, blocks=64)[0]
    b.load_state_dict(a.state_dict())
    assert b.state_digest() == a.state_digest()
    assert np.array_equal(a.propose(acc, 5), b.propose(acc, 5))


@pytest.mark.parametrize("name, params, granularity, text", [
    ("micro", {"cap": 0.5}, "model", "parameter cap=0.5: must be >= 1"),
    ("micro", {"band": 1}, "model", "parameter band=1.0: must be > 1"),
    ("micro", {"below": 1.5}, "model", r"parameter below=1.5: must be in \(0, 1\]"),
    ("micro", {}, "layer", "partitions the whole flat parameter vector"),
    ("exdyna", {}, "layer", "partitions the whole flat parameter vector"),
    ("exdyna", {"blocks": 5000}, "model", "blocks=5000 must be at least the world size"),
    ("exdyna", {"blocks": 2}, "model", r"at least the world size \(4\)"),
    ("exdyna", {"balance": 0.9}, "model", "parameter balance=0.9: must be > 1"),
])
def test_bad_parameters_and_layer_granularity_are_refused(name, params, granularity, text):
    with pytest.raises(PolicyError, match=text):
        build_policy(name, [f"{a}={b}" for a, b in params.items()],
                     Layout(SIZES, granularity), 40, world_size=4)


# ------------------------------------------------------------------ real multi-worker runs
# in training the gradient's scale falls faster than the threshold's 0.5% a round, and the
# count lags below k (docs/policies.md: 0.50 here for micro, 0.48 for exdyna)
WARMUP, LOW, HIGH = 150, 0.3, 1.15


def launch(out, *args):
    r = run_launch("--out", str(out), "--quiet",
                   "--workers", "4", "--model", "mlp", "--dataset", "digits",
                   "--eval-every", "0", *args, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((out / f"rank-{i}.json").read_text()) for i in range(4)]
    return read_jsonl(out / "metrics.jsonl"), ranks


@pytest.mark.parametrize("name", [pytest.param("micro", marks=pytest.mark.long), "exdyna"])
def test_a_real_run_is_disjoint_every_round_and_holds_the_density(tmp_path, name):
    metrics, ranks = launch(tmp_path / name, "--policy", name, "--density", "0.05",
                            "--iterations", "400", "--policy-arg", "init=0.3")
    assert len(metrics) == 400
    # every proposal kept, every worker pushes the union (proposals disjoint: unit tests)
    assert all(m["proposed"] == m["union"] and m["k"] == [m["union"]] * 4 for m in metrics)
    ratio = [m["union"] / m["budget"] for m in metrics[WARMUP:]]
    assert LOW < np.mean(ratio) < HIGH, np.mean(ratio)
    assert len({r["policy_state"] for r in ranks}) == 1  # threshold and cut on every rank


@pytest.mark.long
def test_an_elastic_run_goes_on_over_the_live_ranks(tmp_path):
    # the survivors' cut is checked at unit level (above: after set_live the partitions cover
    # the model, one owner each); here a real loss: the run ends well, every round keeps every
    # proposal and both survivors agree on the threshold
    server, workers = start(tmp_path, 3, "--elastic", worker_args=(
        "--iterations", "300", "--policy", "micro", "--density", "0.05"))
    try:
        os.kill(workers[1].pid, signal.SIGKILL)
        outs = [w.communicate(timeout=300)[0] for w in (workers[0], workers[2])]
        server_out = server.communicate(timeout=60)[0]
    finally:
        cleanup(server, *workers)
    assert [workers[0].returncode, workers[2].returncode] == [0, 0], outs
    assert server.returncode == 0, server_out
    (lost,) = json.loads((tmp_path / "summary.json").read_text())["lost_workers"]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    after = [m for m in metrics if m["iter"] > lost["iter"]]
    assert after and all(m["workers"] == 2 and m["union"] > 0 for m in after)
    assert all(m["proposed"] == m["union"] and m["k"] == [m["union"]] * m["workers"]
               for m in metrics)
    states = {json.loads((tmp_path / f"rank-{r}.json").read_text())["policy_state"]
              for r in (0, 2)}
    assert len(states) == 1
