"""Server size limit (nothing lost) and the dense switch, on a real server process."""

from __future__ import annotations

import numpy as np
import pytest
from test_server import NUMEL, random_push, start_clients

from psparse.ops.aggregate.reference import sparse_mean
from psparse.server.aggregation import ServerLimit
from psparse.wire import protocol


@pytest.mark.parametrize("limit", [1, 7, 40, 200])
def test_limit_conserves_every_pushed_value(limit):
    rng = np.random.default_rng(limit)
    n, rounds = 4, 30
    lim = ServerLimit(NUMEL, (limit, "entries"))
    scratch = np.zeros(NUMEL, np.float32)
    pushed = np.zeros(NUMEL)
    broadcast = np.zeros(NUMEL)
    for _ in range(rounds):
        pushes = [random_push(rng, int(rng.integers(0, 50))) for _ in range(n)]
        for idx, val in pushes:
            pushed[idx] += val / n
        union, mean = sparse_mean(scratch, [p[0] for p in pushes], [p[1] for p in pushes])
        idx, val = lim.apply(union, mean, limit)
        assert idx.size <= limit and np.all(np.diff(idx) > 0)
        broadcast[idx] += val
    held = np.zeros(NUMEL)
    held[lim.support] = lim.residual[lim.support]
    np.testing.assert_allclose(pushed, broadcast + held, atol=1e-5)
    assert np.count_nonzero(lim.residual) <= lim.support.size  # residual lives on its support
    assert not np.any(scratch)


def test_limit_sends_the_largest_and_holds_the_rest():
    lim = ServerLimit(10, (2, "entries"))
    idx, val = lim.apply(np.array([1, 4, 7]), np.array([0.5, -3.0, 2.0], np.float32), 2)
    assert idx.tolist() == [4, 7] and lim.support.tolist() == [1]
    idx, val = lim.apply(np.array([2]), np.array([0.1], np.float32), 2)
    assert idx.tolist() == [1, 2] and val.tolist() == pytest.approx([0.5, 0.1])
    assert lim.support.size == 0
    assert ServerLimit(10, (1.5, "k")).entries(100, 8) == 150
    assert ServerLimit(10, (0, "Nk")).entries(100, 8) == 800


def test_limited_server_broadcasts_at_most_l_and_loses_nothing(server_factory):
    n, rounds, limit = 3, 8, 25
    server = server_factory(n, extra=("--server-limit", str(limit)))
    clients = start_clients(server, n, rounds)
    rng = np.random.default_rng(3)
    pushed, received = np.zeros(NUMEL), np.zeros(NUMEL)
    for it in range(rounds):
        for c in clients:
            idx, val = random_push(rng, 20)
            pushed[idx] += val / n
            c.push(it, idx, val)
        aggs = [c.recv() for c in clients]
        assert all(np.array_equal(a.indices, aggs[0].indices) for a in aggs)
        assert aggs[0].indices.size <= limit
        received[aggs[0].indices] += aggs[0].values
    for c in clients:
        c.finish(rounds - 1)
    assert server.wait()[0] == 0
    with np.load(server.out / "server_residual.npz") as z:
        received[z["indices"]] += z["values"]
    np.testing.assert_allclose(pushed, received, atol=1e-5)
    metrics = server.metrics()
    assert all(m["broadcast_entries"] <= limit < m["union"] for m in metrics)
    assert metrics[-1]["residual_entries"] == np.load(server.out / "server_residual.npz")[
        "indices"].size


def test_bad_limit_is_refused(server_factory, tmp_path):
    import subprocess

    from conftest import python_module

    r = subprocess.run(python_module("psparse.server", "--workers", "1", "--server-limit",
                                     "lots"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "server limit 'lots'" in r.stderr


def test_dense_switch_when_the_union_is_large(server_factory):
    n = 2
    server = server_factory(n)
    clients = start_clients(server, n, 2)
    full = np.arange(NUMEL, dtype=np.int32)
    values = [np.full(NUMEL, float(r + 1), np.float32) for r in range(n)]
    for c in clients:  # a dense push
        c.send(protocol.encode("push", None, values[c.rank], iter=0, rank=c.rank, dense=True))
    for c in clients:
        agg = c.recv()
        assert agg.get("dense") and agg.indices is None
        np.testing.assert_allclose(agg.values, 1.5)
    for c in clients:  # sparse pushes whose union makes dense cheaper for the broadcast
        half = full[c.rank::2][: NUMEL // 2]
        c.push(1, half, np.ones(half.size, np.float32))
    for c in clients:
        agg = c.recv()
        assert agg.get("dense") and agg.values.size == NUMEL
        np.testing.assert_allclose(agg.values, 0.5)
    for c in clients:
        c.finish(1)
    assert server.wait()[0] == 0
    m = server.metrics()
    assert [r["dense"] for r in m] == [True, True]
    # dense is cheaper: NUMEL floats instead of NUMEL (index, value) pairs
    assert all(r["broadcast_bytes"] < n * (NUMEL * 4 + 200) for r in m)


def test_dense_message_must_match_the_model(server_factory):
    server = server_factory(1)
    (c,) = start_clients(server, 1, 1)
    c.send(protocol.encode("push", None, np.ones(NUMEL - 1, np.float32), iter=0, rank=0,
                           dense=True))
    msg = c.recv()
    assert msg.type == "error" and f"has {NUMEL - 1} values, the model {NUMEL}" in msg["message"]
    server.kill()


