"""Strangers cannot break a run (issue 14): each disturbed run ends exactly as the undisturbed one.

A real psparse-server with a run token, two real psparse-worker processes (ranks 0 and 1) and a
hand-written rank 2 that adopts the run and opts out of checksums (docs/protocol.md). Scenarios:
a peer without the token tries to take rank 1 first (with a wrong model size); a token holder
registers rank 1 and leaves before training; rank 2 pushes over its budget; rank 2 pushes dense
under a sparse budget. Refused messages get an error and change nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import python_module, read_jsonl

from psparse.ops.codec.codec import KeyCache
from psparse.wire import protocol, run_description
from psparse.wire.transport import Channel

TOKEN = "test-run-secret"
ITERATIONS = 30
WORKER_ARGS = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations",
               str(ITERATIONS), "--eval-every", "10", "--check-every", "1", "--seed", "5",
               "--timeout", "20"]
TIMING = ("round_s", "time_s", "wall_s", "iterations_per_s", "train_s", "train_iterations_per_s")
WRONG_RUN = {"numel": 5, "iterations": ITERATIONS, "two_phase": False,
             "steps": [[0, 1, 1, 0]], "config": {}}


def recv(channel: Channel, numel=None, cache=None, timeout=30.0) -> protocol.Message:
    """The next message from the server, heartbeats skipped."""
    deadline = time.monotonic() + timeout
    while True:
        got = channel.recv(max(0.0, deadline - time.monotonic()))
        assert got is not None, "nothing from the server"
        msg = protocol.decode(got[1], numel=numel, cache=cache)
        if msg.type != "heartbeat":
            return msg


def register(rank, token=None, **fields):
    proof = {}
    if token:
        nonce = secrets.token_hex(16)
        proof = {"nonce": nonce, "proof": run_description.register_proof(token, rank, 3, nonce)}
    return protocol.encode("register", rank=rank, world_size=3, **proof, **fields)


class ScriptedRank2(threading.Thread):
    """Rank 2, by hand: adopts the run, pushes budget/2 deterministic entries each round.
    ``bad`` maps an iteration to a message (built from the run) sent first, to be refused."""

    def __init__(self, port: int, bad: dict):
        super().__init__(daemon=True)
        self.port, self.bad = port, bad
        self.refusals: list[str] = []
        self.exc: BaseException | None = None

    def run(self):
        channel = Channel.client("127.0.0.1", self.port)
        try:
            channel.send(register(2, TOKEN))  # no run: adopt; no checksum: opt out
            ready = recv(channel)
            assert ready.type == "ready", ready.header
            run = ready["run"]
            numel, cache = run["numel"], KeyCache()
            for it in range(run["iterations"]):
                budget, push_max, _ = run_description.step_at(run, it)
                if it in self.bad:
                    channel.send(self.bad[it](it, numel, push_max))
                    refused = recv(channel, numel, cache)
                    assert refused.type == "error", refused.header
                    self.refusals.append(refused["message"])
                rng = np.random.default_rng(it)
                idx = np.sort(rng.choice(numel, budget // 2, replace=False)).astype(np.int32)
                val = (rng.standard_normal(idx.size) * 1e-3).astype(np.float32)
                channel.send(protocol.encode("push", idx, val, model_size=numel, cache=cache,
                                             iter=it, rank=2, loss=0.0))
                agg = recv(channel, numel, cache)
                assert agg.type == "aggregate" and agg["iter"] == it, agg.header
            channel.send(protocol.encode("metrics", iter=run["iterations"] - 1, rank=2,
                                         report={"final": True}))
            end = recv(channel, numel, cache)
            assert end.type == "shutdown" and end["ok"], end.header
        except BaseException as exc:  # reported by the test
            self.exc = exc
        finally:
            channel.close(linger_s=0.5)


def over_budget(it, numel, push_max):
    idx = np.arange(push_max + 1, dtype=np.int32)
    return protocol.encode("push", idx, np.ones(idx.size, np.float32), iter=it, rank=2)


def dense_under_sparse_budget(it, numel, push_max):
    values = np.zeros(numel, np.float32)
    values[:push_max] = 1.0  # within the cap in entries, but dense where the cap is sparse
    return protocol.encode("push", None, values, iter=it, rank=2, dense=True)


def run_scenario(out, scenario: str) -> dict:
    out.mkdir(parents=True)
    server = subprocess.Popen(python_module("psparse.server", "--workers", "3", "--port", "0",
                                            "--out", str(out), "--timeout", "20",
                                            "--run-token", TOKEN),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs, stranger, refused = [server], None, None
    try:
        while not (out / "server.port").is_file():
            assert server.poll() is None, server.communicate()[0]
            time.sleep(0.02)
        port = int((out / "server.port").read_text())
        if scenario == "stranger-takes-rank-1":
            # no token, a wrong model size: refused, and it stays connected all run long
            stranger = Channel.client("127.0.0.1", port)
            stranger.send(register(1, run=WRONG_RUN, checksum="x"))
            refused = recv(stranger)
        if scenario == "registers-and-leaves":
            leaver = Channel.client("127.0.0.1", port)
            leaver.send(register(1, TOKEN, run=WRONG_RUN, checksum="x"))
            time.sleep(0.5)  # registered (no reply until every rank is in), then gone
            leaver.close(linger_s=0)
        bad = {4: over_budget} if scenario == "over-budget" else \
            {6: dense_under_sparse_budget} if scenario == "dense-under-sparse-budget" else {}
        rank2 = ScriptedRank2(port, bad)
        rank2.start()
        env = {**os.environ, "PSPARSE_TOKEN": TOKEN}
        for r in (0, 1):
            procs.append(subprocess.Popen(
                python_module("psparse.training.loop", "--rank", str(r), "--connect",
                              f"127.0.0.1:{port}", "--out", str(out), *WORKER_ARGS),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        outputs = [p.communicate(timeout=240)[0] for p in procs[1:]]
        server_out = server.communicate(timeout=60)[0]
        rank2.join(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if stranger is not None:
            stranger.close(linger_s=0)
    assert [p.returncode for p in procs] == [0, 0, 0], (server_out, outputs)
    assert rank2.exc is None, rank2.exc
    return {"server_log": server_out, "refused": refused, "refusals": rank2.refusals,
            "summary": json.loads((out / "summary.json").read_text()),
            "metrics": read_jsonl(out / "metrics.jsonl"), "eval": read_jsonl(out / "eval.jsonl"),
            "checksums": [json.loads((out / f"rank-{r}.json").read_text())["checksum"]
                          for r in (0, 1)]}


def results(run: dict) -> dict:
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    summary = {k: v for k, v in run["summary"].items()
               if k not in (*TIMING, "rejected_messages")}
    return {"summary": summary, "metrics": strip(run["metrics"]), "eval": strip(run["eval"]),
            "checksums": run["checksums"]}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    return run_scenario(tmp_path_factory.mktemp("reference") / "run", "none")


EXPECTED = {  # scenario -> (rejected messages, what the refused peer was told)
    "stranger-takes-rank-1": (1, "register does not prove the run token"),
    "registers-and-leaves": (0, None),
    "over-budget": (1, "push has 25 entries, more than the cap of 24 at iteration 4"),
    "dense-under-sparse-budget": (1, "dense push refused: the push cap at iteration 6 is 24 of "
                                     "2410 entries"),
}


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_a_disturbed_run_ends_as_the_undisturbed_one(tmp_path, undisturbed, scenario):
    run = run_scenario(tmp_path / "run", scenario)
    rejected, message = EXPECTED[scenario]
    assert run["summary"]["status"] == "ok"
    assert run["summary"]["rejected_messages"] == rejected
    told = run["refusals"] + ([run["refused"]["message"]] if run["refused"] else [])
    assert len(told) == (1 if message else 0) and all(message in t for t in told), told
    if scenario == "registers-and-leaves":
        assert "rank 1 is free again: the peer that registered it left" in run["server_log"]
    assert results(run) == results(undisturbed)
    assert undisturbed["summary"]["rejected_messages"] == 0
    assert len(set(run["checksums"])) == 1 and run["summary"]["test_acc"] is not None


def test_a_replayed_register_and_a_second_claim_on_a_bound_rank_are_refused(server_factory):
    server = server_factory(3, extra=("--run-token", TOKEN))
    run = {**WRONG_RUN, "numel": 100}
    first = Channel.client("127.0.0.1", server.port)
    frames = register(0, TOKEN, run=run)
    first.send(frames)
    # a refused message behind it on the same connection: its error reply means the register
    # was handled (two connections' messages have no order between them)
    first.send(protocol.encode("metrics", iter=0, rank=0, report={}))
    assert "expected register" in recv(first)["message"]
    replay = Channel.client("127.0.0.1", server.port)
    replay.send(frames)  # the same bytes from another peer: the nonce is spent
    assert "nonce already used" in recv(replay)["message"]
    other = Channel.client("127.0.0.1", server.port)
    other.send(register(0, TOKEN, run=run))  # the rank is bound to a connected peer
    assert "rank 0 is already registered by another peer that is still connected" in \
        recv(other)["message"]
    other.send(register(0, "wrong-secret", run=run))
    assert "does not prove the run token" in recv(other)["message"]
    server.kill()
    for c in (first, replay, other):
        c.close(linger_s=0)
