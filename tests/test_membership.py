"""Who is in the run (psparse/server/membership.py): admission, agreement, liveness and losses,
tested on decoded messages without sockets. The server's probe of a peer's connection is a callable;
here it asks a set of the peers that are still "connected"."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from psparse.server.membership import Membership, RunAborted
from psparse.wire import protocol, run_description
from psparse.wire.protocol import ProtocolError

TOKEN = "run-secret"
RUN = {"numel": 100, "iterations": 8, "two_phase": False, "steps": [[0, 10, 10, 0]],
       "config": {"lr": 0.1, "layers": [10, 20, 30], "seed": 3}}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make(world_size=2, *, token=TOKEN, elastic=False, timeout=30.0):
    """A Membership whose probe says a peer is reachable while it is in ``connected``."""
    connected: set[bytes] = set()
    logged: list[str] = []
    clock = Clock()
    members = Membership(world_size, reachable=lambda peer: peer in connected, run_token=token,
                         timeout=timeout, elastic=elastic, log=logged.append, clock=clock)
    members.connected_peers, members.logged, members.test_clock = connected, logged, clock
    return members


_nonces = iter(range(1 << 30))


def register(rank, world_size=2, *, token=TOKEN, nonce=None, run=RUN, **fields):
    """A decoded register (as the server's socket would deliver it), proving ``token``."""
    header = dict(rank=rank, world_size=world_size, **fields)
    if run is not None:
        header["run"] = run
    if token is not None:
        nonce = nonce or f"{next(_nonces):032x}"
        header.update(nonce=nonce,
                      proof=run_description.register_proof(token, rank, world_size, nonce))
    return protocol.decode(protocol.encode("register", **header))


def join(members, peer, msg):
    members.connected_peers.add(peer)
    return members.register(peer, msg)


def trained(world_size=3, **kw):
    """Every rank registered (peer b"p<rank>") and training started."""
    members = make(world_size, **kw)
    for r in range(world_size):
        join(members, f"p{r}".encode(), register(r, world_size))
    assert members.complete()
    members.start_training(RUN["iterations"])
    return members


# -------------------------------------------------------------------------------- admission
def test_a_register_that_proves_the_token_is_admitted_and_bound():
    members = make()
    assert join(members, b"A", register(1)) == 1
    assert members.peers == {b"A": 1} and members.rank_peer == {1: b"A"}
    assert members.missing() == [0] and not members.complete()
    join(members, b"B", register(0))
    assert members.complete() and members.missing() == []


@pytest.mark.parametrize("token", ["another-secret", None])
def test_a_register_without_the_token_is_refused(token):
    members = make()
    with pytest.raises(ProtocolError, match=r"^register does not prove the run token \(fields "
                                            r"nonce and proof; docs/protocol.md, Admission\)$"):
        join(members, b"A", register(0, token=token))
    assert members.peers == {} and members.registrations == {}


def test_a_proof_for_another_rank_is_refused():
    members = make()
    msg = register(0)
    msg.header["rank"] = 1  # the proof covers rank 0
    with pytest.raises(ProtocolError, match="does not prove the run token"):
        join(members, b"A", msg)


def test_a_replayed_nonce_is_refused_whoever_sends_it():
    members = make()
    join(members, b"A", register(0, nonce="00ff"))
    with pytest.raises(ProtocolError, match=r"^register nonce already used \(a replayed "
                                            r"register\)$"):
        join(members, b"M", register(1, nonce="00ff"))
    with pytest.raises(ProtocolError, match="nonce already used"):
        join(members, b"A", register(0, nonce="00ff"))  # the same peer's replay too
    assert members.rank_peer == {0: b"A"}
    join(members, b"A", register(0))  # a fresh nonce: the latest register counts


def test_without_a_run_token_any_register_is_admitted():
    members = make(token=None)
    assert join(members, b"A", register(0, token=None)) == 0
    assert join(members, b"B", register(1, token="whatever")) == 1  # nonce, proof ignored


def test_world_size_rank_and_message_type_are_checked():
    members = make()
    with pytest.raises(ProtocolError, match=r"^world_size 3 does not match the server's 2$"):
        join(members, b"A", register(0, world_size=3))
    with pytest.raises(ProtocolError, match=r"^rank 2 out of range \[0, 2\)$"):
        join(members, b"A", register(2))
    with pytest.raises(ProtocolError, match="^expected register before training starts, got "
                                            "metrics$"):
        members.register(b"A", protocol.decode(protocol.encode(
            "metrics", iter=0, rank=0, report={})))
    bad = copy.deepcopy(RUN)
    bad["steps"] = []
    with pytest.raises(ProtocolError, match="run field 'steps' is empty"):
        join(members, b"A", register(0, run=bad))
    assert members.registrations == {}


def test_a_rank_stays_with_the_first_peer_that_proves_it():
    members = make()
    join(members, b"A", register(0))
    with pytest.raises(ProtocolError, match=r"^rank 0 is already registered by another peer "
                                            r"that is still connected$"):
        join(members, b"M", register(0))
    assert members.rank_peer == {0: b"A"} and b"M" not in members.peers
    with pytest.raises(ProtocolError, match=r"^this peer already registered as rank 0$"):
        join(members, b"A", register(1))  # one peer, one rank
    assert members.rank_peer == {0: b"A"}


def test_the_rank_of_a_peer_that_left_goes_to_the_next_prover():
    members = make()
    first = register(0, checksum="old")
    join(members, b"A", first)
    members.connected_peers.discard(b"A")  # A's connection closed before training
    newer = register(0, checksum="new")
    assert join(members, b"B", newer) == 0
    assert members.rank_peer == {0: b"B"} and members.peers == {b"B": 0}
    assert members.registrations[0] is newer
    assert members.logged == ["rank 0 is free again: the peer that registered it left (its "
                              "connection closed; the rank goes to the new peer)"]


def test_a_peer_that_left_after_registering_frees_its_rank_before_the_start():
    members = make()
    join(members, b"A", register(0))
    join(members, b"B", register(1))
    members.connected_peers.discard(b"B")
    assert not members.complete()  # B is probed and freed: the run does not start without 1
    assert members.missing() == [1] and members.rank_peer == {0: b"A"}
    join(members, b"C", register(1))
    assert members.complete()


# -------------------------------------------------------------------------------- agreement
def agreeing(*runs, **fields):
    members = make(len(runs))
    for r, run in enumerate(runs):
        extra = {k: v[r] for k, v in fields.items() if v[r] is not None}
        join(members, f"p{r}".encode(), register(r, len(runs), run=run, **extra))
    return members


def changed(path, value):
    run = copy.deepcopy(RUN)
    target = run
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return run


def test_registrations_that_agree_give_the_run():
    members = agreeing(RUN, None, copy.deepcopy(RUN))  # rank 1 adopts the others' run
    assert members.agree(0) == RUN


@pytest.mark.parametrize("path, value, text", [
    (("numel",), 101, "workers disagree on numel: rank 0=100, rank 1=101"),
    (("config", "lr"), 0.2, "workers disagree on config.lr: rank 0=0.1, rank 1=0.2"),
    (("config", "seed"), 3.0, "workers disagree on config.seed: rank 0=3, rank 1=3.0"),
    (("config", "layers"), [10, 21, 30],
     "workers disagree on config.layers[1]: rank 0=20, rank 1=21"),
    (("config", "layers"), [10, 20],
     "workers disagree on config.layers[2]: rank 0=30, rank 1='(none: the list ends)'"),
    (("steps",), [[0, 10, 9, 0]], "workers disagree on steps[0]: rank 0=[0, 10, 10, 0], "
                                  "rank 1=[0, 10, 9, 0]"),
])
def test_a_disagreement_names_the_field(path, value, text):
    members = agreeing(RUN, changed(path, value))
    with pytest.raises(RunAborted) as exc:
        members.agree(0)
    assert str(exc.value) == text


def test_a_config_entry_only_one_rank_has_is_named():
    run = changed(("config", "momentum"), 0.9)
    with pytest.raises(RunAborted, match=r"^workers disagree on config.momentum: rank 0=None, "
                                         r"rank 1=0.9$"):
        agreeing(RUN, run).agree(0)


def test_the_first_describing_rank_is_the_reference():
    members = agreeing(None, RUN, changed(("iterations",), 9))
    with pytest.raises(RunAborted, match=r"^workers disagree on iterations: rank 1=8, "
                                         r"rank 2=9$"):
        members.agree(0)


def test_no_run_described_resume_point_and_checksums():
    with pytest.raises(RunAborted, match=r"^no worker described the run \(every register lacks "
                                         r"'run'\)$"):
        agreeing(None, None).agree(0)
    with pytest.raises(RunAborted, match=r"^rank 1 resumes at iteration 20, the server at 0$"):
        agreeing(RUN, RUN, start=[None, 20]).agree(0)
    assert agreeing(RUN, RUN, start=[20, 20]).agree(20) == RUN
    with pytest.raises(RunAborted, match=r"^workers disagree on checksum \(initial weights\): "
                                         r"rank 0=aa, rank 1=bb$"):
        agreeing(RUN, RUN, checksum=["aa", "bb"]).agree(0)
    # a worker without a checksum opts out of the comparison
    assert agreeing(RUN, RUN, RUN, checksum=["aa", None, "aa"]).agree(0) == RUN


# -------------------------------------------------------------------------------- liveness
def heartbeat(rank=None, token=None):
    fields = {} if rank is None else {"rank": rank, "token": token}
    return protocol.decode(protocol.encode("heartbeat", **fields))


def test_heartbeats_need_the_ranks_token_and_keep_it_alive():
    members = trained(3)
    assert len(set(members.tokens.values())) == 3  # a token per rank
    clock = members.test_clock
    clock.now += 25
    members.heartbeat(heartbeat(1, members.tokens[1]))  # from any connection
    assert members.last_seen[1] == clock.now and members.last_seen[0] == clock.now - 25
    for bad in (heartbeat(1, members.tokens[2]), heartbeat(7, "x"), heartbeat()):
        with pytest.raises(ProtocolError, match=r"^heartbeat with an unknown rank or token$"):
            members.heartbeat(bad)
    clock.now += 10
    assert members.silent([0, 1, 2]) == [0, 2]  # 35 s > 30 s; rank 1 was heard 10 s ago
    members.seen(b"p2")  # any message from its peer counts too
    assert members.silent([0, 1, 2]) == [0]
    assert members.silent([1, 2]) == []


def test_training_messages_must_come_from_a_rank_speaking_for_itself():
    members = trained(2)
    push = protocol.decode(protocol.encode("push", [1], [1.0], iter=0, rank=1))
    assert members.sender(b"p1", push) == 1
    with pytest.raises(ProtocolError, match=r"^peer registered as rank 0 cannot send for "
                                            r"rank 1$"):
        members.sender(b"p0", push)
    with pytest.raises(ProtocolError, match=r"^peer is not a registered worker of this run$"):
        members.sender(b"stranger", push)
    with pytest.raises(ProtocolError, match=r"^training has started; register is no longer "
                                            r"accepted$"):
        members.sender(b"p0", register(0))


# ---------------------------------------------------------------------------------- losses
def test_an_elastic_run_loses_ranks_and_moves_the_evaluator():
    members = trained(4, elastic=True)
    members.lose([2], 3, "push messages")
    assert members.active == {0, 1, 3} and members.lost == [{"rank": 2, "iter": 3}]
    assert members.evaluators == [{"rank": 0, "from_iter": 0}]  # rank 0 still evaluates
    members.lose([0, 1], 5, "push messages", "out of memory")
    assert members.active == {3}
    assert members.evaluators[-1] == {"rank": 3, "from_iter": 5}
    assert members.connected() == [3]
    assert "elastic: rank 3 evaluates from iteration 5 on" in members.logged
    with pytest.raises(ProtocolError, match=r"^rank 0 was dropped from this \(elastic\) run$"):
        members.sender(b"p0", protocol.decode(protocol.encode("metrics", iter=5, rank=0,
                                                              report={})))
    with pytest.raises(RunAborted, match=r"^rank 3 failed at iteration 6: gone$"):
        members.lose([3], 6, "push messages", "gone")  # nobody would be left


def test_an_evaluator_lost_after_the_last_iteration_hands_over_at_the_end():
    members = trained(2, elastic=True)
    members.lose([0], None, "final reports")
    assert members.evaluators[-1] == {"rank": 1, "from_iter": RUN["iterations"]}
    assert members.lost == [{"rank": 0, "iter": None}]


def test_without_elastic_a_loss_ends_the_run_saying_why():
    members = trained(3, timeout=30.0)
    with pytest.raises(RunAborted) as exc:
        members.lose([1], 4, "push messages of iteration 4 from ranks [1]")
    assert str(exc.value) == ("rank 1 stopped answering at iteration 4 (nothing for 30 s while "
                              "waiting for push messages of iteration 4 from ranks [1])")
    with pytest.raises(RunAborted, match=r"^rank 0, 2 failed after the last iteration: its "
                                         r"connection closed$"):
        members.lose([0, 2], None, "final reports", "its connection closed")
    assert members.active == {0, 1, 2} and members.lost == []


def test_the_server_layers_below_the_socket_import_no_transport():
    """aggregation and membership sit below the server's socket side (server/endpoint.py,
    server/server.py): no zmq, no transport, no torch."""
    code = ("import sys, psparse.server.aggregation, psparse.server.membership; "
            "print(sorted(m for m in ('zmq', 'psparse.wire.transport', 'psparse.server.server', "
            "'psparse.server.endpoint', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_resumed_elastic_run_expects_exactly_the_ranks_live_at_its_checkpoint():
    members = make(3, elastic=True)
    members.expect([0, 2])  # rank 1 was lost before the checkpoint
    join(members, b"A", register(0, 3))
    assert members.missing() == [2] and not members.complete()
    with pytest.raises(ProtocolError, match=r"^rank 1 is not in this run: the elastic run lost "
                                            r"it before the checkpoint it resumes from \(live "
                                            r"ranks \[0, 2\]\)$"):
        join(members, b"B", register(1, 3))
    join(members, b"C", register(2, 3))
    assert members.complete()
    members.start_training(RUN["iterations"])
    assert members.active == {0, 2} and sorted(members.tokens) == [0, 2]
