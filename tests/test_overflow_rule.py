"""The overflow rule (docs/protocol.md, Rounds): finite pushes whose sum passes float32's range,
or whose mean plus the server's rounding memory does, end the run naming the iteration, the
key and the ranks; nothing non-finite is ever broadcast or kept. On a real psparse-server
process driven by protocol-speaking clients (test_server.Client); and the dense-push rule of
the spec (Budgets) in an int8 run, where it counts the run's value bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_server import Client, start_clients

from psparse.wire import protocol


def expect_end(clients, server, *, it: int, key: int, ranks: list[int], words: str) -> str:
    """Every client gets shutdown(ok=false) naming the iteration and key; the server's summary
    says failed with the ranks; returns the reason."""
    reasons = set()
    for c in clients:
        msg = c.recv()
        while msg.type == "aggregate":  # (rounds before the one that overflowed)
            assert np.isfinite(msg.values).all()
            msg = c.recv()
        assert msg.type == "shutdown" and not msg["ok"], msg.header
        reasons.add(msg["reason"])
    (reason,) = reasons
    assert f"the aggregate of iteration {it}" in reason and words in reason, reason
    assert f"at key {key}" in reason
    code, out = server.wait()
    assert code == 1, out
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_ranks"] == ranks
    assert summary["error"] == reason
    return reason


@pytest.mark.parametrize("values", [None, {"dtype": "int8", "block": 128,
                                           "server_memory": True}], ids=["float32", "int8"])
def test_finite_pushes_whose_sum_overflows_end_the_run_naming_the_ranks(server_factory,
                                                                        values):
    server = server_factory(3)
    clients = [Client(server.port, r, 3, 4) for r in range(3)]
    for c in clients:
        if values:
            c.run["values"] = values
        c.register()
    for c in clients:
        assert c.recv().type == "ready"
    # key 7: ranks 0 and 2 push 3e38 each (finite; their float32 sum is inf); rank 1 elsewhere
    clients[0].push(0, [2, 7], [1.0, 3e38])
    clients[1].push(0, [3], [1.0])
    clients[2].push(0, [7], [3e38])
    reason = expect_end(clients, server, it=0, key=7, ranks=[0, 2], words="overflows float32")
    assert "ranks [0, 2] pushed values there" in reason


def test_the_rounding_memory_never_holds_an_inf(server_factory):
    """float16 broadcasts clip at 65504 and the server keeps the rest for the next round: with
    1e38 pushed at key 5 every round, the memory holds 1e38, 2e38, 3e38; round 3's mean plus
    memory passes float32's range, and the run ends there instead of keeping inf."""
    server = server_factory(2)
    clients = [Client(server.port, r, 2, 10) for r in range(2)]
    for c in clients:
        c.run["values"] = {"dtype": "float16", "block": 128, "server_memory": True}
        c.register()
    for c in clients:
        assert c.recv().type == "ready"
    for it in range(4):
        for c in clients:
            c.push(it, [5], [1e38])
        if it < 3:
            for c in clients:
                agg = c.recv()
                assert agg.type == "aggregate" and agg.values.tolist() == [65504.0]
    expect_end(clients, server, it=3, key=5, ranks=[0, 1], words="rounding memory")


@pytest.mark.parametrize("values, accepted", [(None, False), ({"dtype": "int8", "block": 128,
                                                               "server_memory": True}, True)],
                         ids=["float32", "int8"])
def test_a_dense_push_is_allowed_where_the_runs_value_bytes_say(server_factory, values,
                                                                accepted):
    """numel 1003, push_max 300: in float32 the sparse form at the cap (300 x 8 = 2400 bytes)
    is smaller than dense (4012), so a dense push is refused; in int8 it is larger (1200 +
    312 = 1512 against 1035), so a dense push is allowed (docs/protocol.md, Budgets)."""
    server = server_factory(1)
    (client,) = [Client(server.port, 0, 1, 2, numel=1003, push_max=300)]
    if values:
        client.run["values"] = values
    client.register()
    assert client.recv().type == "ready"
    dense = np.zeros(1003, np.float32)
    dense[[3, 500]] = [1.0, -2.0]
    client.send(protocol.encode("push", None, dense, iter=0, rank=0, dense=True))
    got = client.ch.recv(10.0)
    assert got is not None
    msg = protocol.decode(got[1], numel=1003)
    while msg.type == "heartbeat":
        msg = protocol.decode(client.ch.recv(10.0)[1], numel=1003)
    if accepted:
        assert msg.type == "aggregate", msg.header
        got = np.zeros(1003, np.float32)
        if msg.get("dense"):
            got[:] = msg.values
        else:
            got[msg.indices] = msg.values
        assert np.flatnonzero(got).tolist() == [3, 500]
    else:
        assert msg.type == "error" and "dense push refused" in msg["message"]


def test_the_size_limits_residual_plus_the_mean_overflowing_ends_the_run(server_factory):
    """--server-limit 1: round 0 sends key 1 and holds key 2's 3e38 back; round 1 pushes 3e38
    at key 2 again: the held value plus the mean passes float32's range."""
    server = server_factory(1, extra=("--server-limit", "1"))
    (client,) = start_clients(server, 1, 4)
    client.push(0, [1, 2], [3.3e38, 3e38])
    agg = client.recv()
    assert agg.type == "aggregate" and agg.indices.tolist() == [1]
    client.push(1, [2, 6], [3e38, 10.0])
    expect_end([client], server, it=1, key=2, ranks=[0], words="size limit's residual")
