"""A real psparse-server process driven over real ZeroMQ sockets by protocol-speaking clients."""

from __future__ import annotations

import json
import selectors
import socket
import threading

import numpy as np
import pytest

from psparse.ops.codec.codec import KeyCache
from psparse.wire import protocol
from psparse.wire.transport import Channel

NUMEL = 1000


class Client:
    """Speaks the worker side of the protocol by hand, so tests choose every byte sent."""

    def __init__(self, port: int, rank: int, world_size: int, iterations: int,
                 numel: int = NUMEL, checksum: str = "c0", push_max: int = NUMEL):
        self.rank = rank
        self.ch = Channel.client("127.0.0.1", port)
        # the run description (docs/protocol.md): budget 10, pushes of up to push_max entries
        self.run = dict(numel=numel, iterations=iterations, two_phase=False,
                        steps=[[0, 10, push_max, 0]], config={"seed": 0})
        self.reg = dict(rank=rank, world_size=world_size, run=self.run, checksum=checksum)
        self.received = {}  # wire bytes received, by message type
        self.cache = KeyCache()  # like a worker: index sets both ends hold
        self.heartbeats = 0

    def register(self):
        self.ch.send(protocol.encode("register", **self.reg))

    def send(self, frames):
        return self.ch.send(frames)

    def push(self, it, idx, val, **kw):
        return self.send(protocol.encode("push", np.asarray(idx, np.int32),
                                         np.asarray(val, np.float32), cache=self.cache, iter=it,
                                         rank=self.rank, **kw))

    def recv(self, timeout=10.0) -> protocol.Message:
        """The server's next message, heartbeats skipped (counted in self.heartbeats)."""
        while True:
            got = self.ch.recv(timeout)
            assert got is not None, f"rank {self.rank}: nothing from the server in {timeout} s"
            _, frames, nbytes = got
            msg = protocol.decode(frames, numel=NUMEL, cache=self.cache)
            if msg.type != "heartbeat":
                break
            self.heartbeats += 1
        # independent of the server's accounting: raw frame sizes + ZMTP frame overhead
        self.received[msg.type] = self.received.get(msg.type, 0) + sum(
            len(f.buffer) + (2 if len(f.buffer) < 256 else 9) for f in frames)
        return msg

    def finish(self, it, checksum="end"):
        self.send(protocol.encode("metrics", iter=it, rank=self.rank, report={"final": True},
                                  checksum=checksum))

    def close(self):
        self.ch.close()


def start_clients(server, world_size, iterations, port=None, **kw):
    clients = [Client(port or server.port, r, world_size, iterations, **kw)
               for r in range(world_size)]
    for c in clients:
        c.register()
    for c in clients:
        assert c.recv().type == "ready"
    return clients


def random_push(rng, k):
    idx = np.sort(rng.choice(NUMEL, size=k, replace=False)).astype(np.int32)
    return idx, rng.standard_normal(k).astype(np.float32)


def test_aggregate_equals_numpy_reference_and_metrics_match(server_factory):
    n, rounds = 3, 6
    server = server_factory(n)
    clients = start_clients(server, n, rounds)
    rng = np.random.default_rng(1)
    sent_bytes = [0] * n
    expected_unions = []
    for it in range(rounds):
        pushes = [random_push(rng, int(rng.integers(0, 60))) for _ in range(n)]
        for c, (idx, val) in zip(clients, pushes):
            sent_bytes[c.rank] += c.push(it, idx, val, loss=float(it))
        dense = np.zeros(NUMEL, np.float32)
        for idx, val in pushes:
            dense[idx] += val
        union = np.unique(np.concatenate([p[0] for p in pushes]))
        expected_unions.append(union.size)
        for c in clients:
            agg = c.recv()
            assert agg.type == "aggregate" and agg["iter"] == it and agg["workers"] == n
            np.testing.assert_array_equal(agg.indices, union)
            np.testing.assert_allclose(agg.values, dense[union] / n, rtol=1e-6, atol=1e-7)
    for c in clients:
        c.finish(rounds - 1)
    for c in clients:
        msg = c.recv()
        assert msg.type == "shutdown" and msg["ok"]
    code, out = server.wait()
    assert code == 0, out

    metrics = server.metrics()
    assert [m["iter"] for m in metrics] == list(range(rounds))
    assert [m["union"] for m in metrics] == expected_unions
    assert [m["broadcast_entries"] for m in metrics] == expected_unions
    assert sum(m["upload_bytes"] for m in metrics) == sum(sent_bytes)
    assert sum(m["broadcast_bytes"] for m in metrics) == sum(c.received["aggregate"]
                                                             for c in clients)
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == rounds


class Relay:
    """A TCP forwarder on loopback that counts the bytes crossing it in each direction."""

    def __init__(self, target_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = target_port
        self.up = self.down = 0  # client->server, server->client
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def counts(self):
        with self.lock:
            return self.up, self.down

    def _serve(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target))
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, (server, "up"))
        sel.register(server, selectors.EVENT_READ, (client, "down"))
        while not self.stop:
            for key, _ in sel.select(0.1):
                data = key.fileobj.recv(1 << 20)
                if not data:
                    self.stop = True
                    break
                dest, direction = key.data
                with self.lock:  # count before forwarding: the peer cannot act on it sooner
                    setattr(self, direction, getattr(self, direction) + len(data))
                dest.sendall(data)
        client.close()
        server.close()


def test_byte_accounting_equals_bytes_on_the_tcp_stream(server_factory):
    """Relays on each worker's TCP connection count the real stream; the metrics must agree."""
    n, rounds = 2, 5
    server = server_factory(n)
    relays = [Relay(server.port) for _ in range(n)]
    clients = [Client(relays[r].port, r, n, rounds) for r in range(n)]
    for c in clients:
        c.register()
    for c in clients:
        assert c.recv().type == "ready"
    before = [r.counts() for r in relays]  # handshake, register and ready are behind us
    rng = np.random.default_rng(7)
    for it in range(rounds):
        for c in clients:
            c.push(it, *random_push(rng, 200))  # > 255-byte frames: 8-byte length fields
        for c in clients:
            assert c.recv()["iter"] == it
    after = [r.counts() for r in relays]
    for c in clients:
        c.finish(rounds - 1)
    assert server.wait()[0] == 0
    metrics = server.metrics()
    up = sum(a[0] - b[0] for a, b in zip(after, before))
    down = sum(a[1] - b[1] for a, b in zip(after, before))
    assert up == sum(m["upload_bytes"] for m in metrics)
    assert down == sum(m["broadcast_bytes"] for m in metrics)
    for r in relays:
        r.stop = True


def test_bad_messages_get_errors_and_the_round_still_completes(server_factory):
    n = 2
    server = server_factory(n)
    clients = start_clients(server, n, 2)
    a, b = clients
    rogue = Client(server.port, 0, n, 2)

    def expect_error(client, frames, reason):
        client.send(frames)
        msg = client.recv()
        assert msg.type == "error" and reason in msg["message"], msg.header

    expect_error(rogue, protocol.encode("push", np.array([1], np.int32), np.ones(1, np.float32),
                                        iter=0, rank=0), "not a registered worker")
    expect_error(a, [b"\x93garbage"], "not valid msgpack")
    expect_error(a, protocol.encode("push", np.array([NUMEL], np.int32),
                                    np.ones(1, np.float32), iter=0, rank=0),
                 f"index {NUMEL} out of range")
    expect_error(a, protocol.encode("push", np.array([1], np.int32),
                                    np.array([np.nan], np.float32), iter=0, rank=0), "NaN")
    expect_error(a, protocol.encode("push", np.array([1], np.int32), np.ones(1, np.float32),
                                    iter=0, rank=1), "cannot send for rank 1")
    expect_error(a, protocol.encode("push", np.array([1], np.int32), np.ones(1, np.float32),
                                    iter=5, rank=0), "server is at iteration 0")
    expect_error(a, protocol.encode("register", **a.reg), "no longer accepted")
    # well-behaved pushes still make a correct round
    a.push(0, [2, 3], [1.0, 2.0])
    expect_error(a, protocol.encode("push", np.array([1], np.int32), np.ones(1, np.float32),
                                    iter=0, rank=0), "already sent push")
    b.push(0, [3, 4], [4.0, 8.0])
    for c in clients:
        agg = c.recv()
        assert agg.indices.tolist() == [2, 3, 4]
        assert agg.values.tolist() == [0.5, 3.0, 4.0]
    for c in clients:  # empty pushes are legal and never block a round
        c.push(1, [], [])
    for c in clients:
        assert c.recv()["count"] == 0
    for c in clients:
        c.finish(1)
    assert server.wait()[0] == 0
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["rejected_messages"] == 8
    assert [m["union"] for m in server.metrics()] == [3, 0]


def test_workers_that_disagree_are_refused(server_factory):
    server = server_factory(2)
    a = Client(server.port, 0, 2, 3, checksum="aaa")
    b = Client(server.port, 1, 2, 3, checksum="bbb")
    a.register()
    b.register()
    msg = a.recv()
    assert msg.type == "shutdown" and not msg["ok"]
    assert "disagree on checksum" in msg["reason"]
    code, out = server.wait()
    assert code == 1 and "rank 0=aaa, rank 1=bbb" in out


def test_diverged_replicas_stop_the_run(server_factory):
    server = server_factory(2)
    a, b = start_clients(server, 2, 3)
    a.push(0, [1], [1.0], checksum="same")
    b.push(0, [1], [1.0], checksum="different")
    msg = a.recv()
    assert msg.type == "shutdown" and "replicas diverged" in msg["reason"]
    assert server.wait()[0] == 1


def test_missing_worker_times_out_with_a_clear_error(server_factory):
    server = server_factory(2, timeout=1.5, extra=("--register-timeout", "1.5"))
    a = Client(server.port, 0, 2, 3)
    a.register()
    code, out = server.wait()
    assert code == 1 and "missing ranks [1]" in out
    assert "raise --register-timeout" in out  # what to do when workers start slowly
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["status"] == "failed" and "timed out" in summary["error"]


@pytest.mark.parametrize("world", [1, 4])
def test_world_sizes(server_factory, world):
    server = server_factory(world)
    clients = start_clients(server, world, 1)
    for c in clients:
        c.push(0, [c.rank], [float(c.rank + 1)])
    for c in clients:
        agg = c.recv()
        assert agg.indices.tolist() == list(range(world))
        np.testing.assert_allclose(agg.values, np.arange(1, world + 1) / world)
    for c in clients:
        c.finish(0)
    assert server.wait()[0] == 0


def test_two_phase_round_keeps_the_proposals_of_largest_mean_magnitude(server_factory):
    n = 3
    server = server_factory(n)
    clients = [Client(server.port, r, n, 1) for r in range(n)]
    for c in clients:
        c.run.update(two_phase=True, steps=[[0, 10, 2, NUMEL]])  # the group keeps 2
        c.register()
    for c in clients:
        assert c.recv().type == "ready"
    proposals = {0: ([1, 5, 9], [3.0, -1.0, 0.5]), 1: ([5, 9], [-4.0, 0.25]), 2: ([], [])}
    for c in clients:
        idx, val = proposals[c.rank]
        c.send(protocol.encode("propose", np.array(idx, np.int32), np.array(val, np.float32),
                               iter=0, rank=c.rank))
    # mean |value| over 3 workers: 1 -> 1.0, 5 -> 5/3, 9 -> 0.25: keep {1, 5}
    for c in clients:
        msg = c.recv()
        assert msg.type == "indices" and msg.indices.tolist() == [1, 5]
    for c in clients:
        c.push(0, [1, 5], [1.0, float(c.rank)])
    for c in clients:
        agg = c.recv()
        assert agg.indices.tolist() == [1, 5] and agg.values.tolist() == [1.0, 1.0]
    for c in clients:
        c.finish(0)
    assert server.wait()[0] == 0
    (m,) = server.metrics()
    assert m["proposed"] == 3 and m["union"] == 2


def test_only_the_evaluators_results_are_recorded(server_factory):
    """A registered worker at another rank cannot overwrite the run's evaluation."""
    server = server_factory(2)
    clients = start_clients(server, 2, 1)
    for c in clients:
        c.push(0, [c.rank], [1.0])
    for c in clients:
        assert c.recv().type == "aggregate"
    clients[1].send(protocol.encode("metrics", iter=0, rank=1, report={"test_acc": 0.99}))
    clients[0].send(protocol.encode("metrics", iter=0, rank=0, report={"test_acc": 0.25}))
    for c in clients:
        c.finish(0)
    for c in clients:
        assert c.recv().type == "shutdown"
    assert server.wait()[0] == 0
    evals = [json.loads(line) for line in (server.out / "eval.jsonl").read_text().splitlines()]
    assert [e["test_acc"] for e in evals] == [0.25]
    assert json.loads((server.out / "summary.json").read_text())["test_acc"] == 0.25
