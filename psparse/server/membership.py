"""Who is in the run: admission, the agreed run, liveness, losses. Sends nothing itself.

``Membership`` holds the server's view of its workers (docs/protocol.md, "The run",
"Admission", "Liveness"):

* admission: a ``register`` must prove the run token (HMAC) with an unused nonce; a rank is
  bound to the first peer that proves it, and freed again if that peer left before training
  (the server's probe of a peer's connection is the ``reachable`` callable it passes in);
* agreement: every registration describes the same run (``agree``, naming the first field that
  differs), or the run cannot start;
* liveness: the heartbeat tokens handed out in ``ready``, when each rank was last heard from,
  and which ranks have been silent too long;
* losses: the active set, the lost workers and, in an elastic run, the evaluator hand-over;
  without ``--elastic`` a loss ends the run (``RunAborted``).

Peers are opaque routing ids (whatever the transport names a connection by).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Hashable

from ..wire import protocol, run_description
from ..wire.protocol import ProtocolError

__all__ = ["Membership", "RunAborted", "BEFORE_TRAINING"]

# how the run's end reads when a worker reported that it could not start (summary.json's error)
BEFORE_TRAINING = "failed before training started"


class RunAborted(RuntimeError):
    """The run cannot go on (timeout, disagreement, diverged replicas); the text says why.
    ``ranks``: the workers that caused it, when known (summary.json's ``failed_ranks``)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks


class Membership:
    def __init__(self, world_size: int, *, reachable: Callable[[Hashable], bool],
                 run_token: str | None = None, timeout: float = 60.0, elastic: bool = False,
                 log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.world_size = world_size
        self.reachable = reachable  # whether a peer's connection is still open (the server probes)
        self.run_token = run_token or None  # a register must prove it (HMAC), when set
        self.timeout = timeout  # seconds of silence after which a rank is lost
        self.elastic = elastic
        self.log = log or (lambda msg: None)
        self.clock = clock
        self._nonces: set[str] = set()  # register nonces seen: a replayed register is refused
        self.peers: dict[Hashable, int] = {}  # routing id -> rank
        self.rank_peer: dict[int, Hashable] = {}
        self.registrations: dict[int, protocol.Message] = {}
        # the ranks that must register: all, unless a resumed elastic run lost some (``expect``)
        self.expected: set[int] = set(range(world_size))
        self.training = False  # registration is over; ranks can no longer be rebound
        self.iterations = 0  # the run's length, once training started
        self.active: set[int] = set(range(world_size))
        self.lost: list[dict] = []
        self.evaluators = [{"rank": 0, "from_iter": 0}]  # moves on if an elastic run loses 0
        self.tokens: dict[int, str] = {}  # heartbeat tokens, from training on
        self.last_seen: dict[int, float] = {}

    # -------------------------------------------------------------------------- registration
    def expect(self, ranks) -> None:
        """Only ``ranks`` take part: an elastic run resumed from a checkpoint after it lost
        workers goes on with the ranks live at that checkpoint (the others' state is gone)."""
        self.expected = set(ranks)

    def missing(self) -> list[int]:
        """The expected ranks no peer has registered yet."""
        return sorted(self.expected - set(self.registrations))

    def register(self, peer: Hashable, msg: protocol.Message) -> int:
        """Admit a decoded ``register`` from ``peer`` and bind its rank to it; the rank.

        Raises ProtocolError (the register is refused, nothing bound) unless it is a valid
        register that proves the run token with an unused nonce, for a rank this peer may take:
        a rank stays with the first peer that took it while that peer is reachable.
        """
        if msg.type != "register":
            raise ProtocolError(f"expected register before training starts, got {msg.type}")
        rank = msg["rank"]
        if msg["world_size"] != self.world_size:
            raise ProtocolError(f"world_size {msg['world_size']} does not match the server's "
                                f"{self.world_size}")
        if rank >= self.world_size:
            raise ProtocolError(f"rank {rank} out of range [0, {self.world_size})")
        if rank not in self.expected:
            raise ProtocolError(f"rank {rank} is not in this run: the elastic run lost it "
                                "before the checkpoint it resumes from (live ranks "
                                f"{sorted(self.expected)})")
        self._check_proof(msg)
        if "run" in msg.header:
            run_description.check_run(msg["run"])
        if peer in self.peers and self.peers[peer] != rank:
            raise ProtocolError(f"this peer already registered as rank {self.peers[peer]}")
        if rank in self.rank_peer and self.rank_peer[rank] != peer:
            if self.reachable(self.rank_peer[rank]):
                raise ProtocolError(f"rank {rank} is already registered by another peer that "
                                    "is still connected")
            self.unbind(rank, "its connection closed; the rank goes to the new peer")
        self.registrations[rank] = msg  # the latest register of this peer counts
        self.peers[peer], self.rank_peer[rank] = rank, peer
        return rank

    def failed_before_training(self, peer: Hashable, msg: protocol.Message) -> str:
        """A worker's ``error`` before ``ready`` (it cannot start: a bad model, a refused
        register, ...): the reason the run cannot start, naming its rank. Raises ProtocolError
        unless the sender holds the rank (its register was accepted) or names one and proves
        the run token for it (docs/protocol.md, Admission), so a stranger cannot end the run."""
        rank = self.peers.get(peer)
        if rank is None:
            rank = msg.get("rank")
            if rank is None or rank >= self.world_size:
                raise ProtocolError("a worker's error before training must name its rank "
                                    f"(0 <= rank < {self.world_size})")
            self._check_proof(msg)
        elif msg.get("rank", rank) != rank:
            raise ProtocolError(f"peer registered as rank {rank} cannot send for rank "
                                f"{msg['rank']}")
        return f"rank {rank} {BEFORE_TRAINING}: {msg['message']}"

    def _check_proof(self, msg: protocol.Message) -> None:
        """A register (or an early error) proves the run token with an unused nonce, when the
        server has a token; ProtocolError otherwise."""
        if self.run_token is None:
            return
        what = "register" if msg.type == "register" else "error before training"
        if not run_description.proof_is_valid(self.run_token, msg.header):
            raise ProtocolError(f"{what} does not prove the run token (fields nonce and "
                                "proof; docs/protocol.md, Admission)")
        if msg["nonce"] in self._nonces:
            raise ProtocolError(f"{msg.type} nonce already used (a replayed {msg.type})")
        self._nonces.add(msg["nonce"])

    def unbind(self, rank: int, why: str) -> None:
        """Free a rank whose peer registered and left before training: another may take it."""
        peer = self.rank_peer.pop(rank, None)
        self.peers.pop(peer, None)
        self.registrations.pop(rank, None)
        self.log(f"rank {rank} is free again: the peer that registered it left ({why})")

    def complete(self) -> bool:
        """Every expected rank is registered by a peer that is still reachable (one that left
        is freed)."""
        if set(self.registrations) != self.expected:
            return False
        for rank in sorted(self.registrations):
            if not self.reachable(self.rank_peer[rank]):
                self.unbind(rank, "its connection closed")
        return set(self.registrations) == self.expected

    def agree(self, start: int) -> dict:
        """The run all registrations describe (and resume at ``start``), or RunAborted naming
        the first disagreement."""
        regs = self.registrations
        for r, m in regs.items():
            if m.get("start", 0) != start:
                raise RunAborted(f"rank {r} resumes at iteration {m.get('start', 0)}, the server "
                                 f"at {start}")
        described = {r: m["run"] for r, m in sorted(regs.items()) if "run" in m.header}
        if not described:
            raise RunAborted("no worker described the run (every register lacks 'run')")
        first, reference = next(iter(described.items()))
        for r, run in described.items():
            field = run_description.run_difference(reference, run)
            if field is not None:
                mine, theirs = _lookup(reference, field), _lookup(run, field)
                if isinstance(mine, list) and isinstance(theirs, list):  # e.g. config.layers
                    at = next((i for i, (x, y) in enumerate(zip(mine, theirs))
                               if not run_description.same_value(x, y)),
                              min(len(mine), len(theirs)))
                    mine, theirs = _item(mine, at), _item(theirs, at)
                    field = f"{field}[{at}]"
                raise RunAborted(f"workers disagree on {field}: rank {first}={mine!r}, "
                                 f"rank {r}={theirs!r}")
        # workers that omit the checksum opt out of replica comparison (docs/protocol.md)
        checksums = {r: m["checksum"] for r, m in sorted(regs.items()) if "checksum" in m.header}
        if len(set(checksums.values())) > 1:
            raise RunAborted("workers disagree on checksum (initial weights): " +
                             ", ".join(f"rank {r}={c}" for r, c in checksums.items()))
        return reference

    def start_training(self, iterations: int) -> None:
        """Registration is over: every expected rank is active, heard from now, with a fresh
        heartbeat token (sent in its ``ready``)."""
        self.iterations = iterations
        self.active = set(self.expected)
        self.tokens = {r: secrets.token_hex(8) for r in sorted(self.expected)}
        self.last_seen = {r: self.clock() for r in sorted(self.expected)}
        self.training = True

    # ----------------------------------------------------------------- messages and liveness
    def connected(self) -> list[int]:
        """The active ranks that a peer is bound to, in rank order."""
        return sorted(self.active & set(self.rank_peer))

    def seen(self, peer: Hashable) -> None:
        """Something came from ``peer``: if it holds a rank, that rank is alive now."""
        rank = self.peers.get(peer)
        if rank is not None:
            self.last_seen[rank] = self.clock()

    def heartbeat(self, msg: protocol.Message) -> None:
        """A worker's heartbeat (on any connection) must name its rank and that rank's token."""
        beat = msg.get("rank")
        if beat is None or self.tokens.get(beat) != msg.get("token"):
            raise ProtocolError("heartbeat with an unknown rank or token")
        if beat in self.active:
            self.last_seen[beat] = self.clock()

    def sender(self, peer: Hashable, msg: protocol.Message) -> int:
        """The rank a training-time message comes from; ProtocolError unless the peer is a
        worker still in the run, speaking for its own rank."""
        rank = self.peers.get(peer)
        if rank is None:
            raise ProtocolError("peer is not a registered worker of this run")
        if rank not in self.active:
            raise ProtocolError(f"rank {rank} was dropped from this (elastic) run")
        if msg.type == "register":
            raise ProtocolError("training has started; register is no longer accepted")
        if "rank" in msg.header and msg["rank"] != rank:
            raise ProtocolError(f"peer registered as rank {rank} cannot send for rank "
                                f"{msg['rank']}")
        return rank

    def silent(self, ranks, now: float | None = None) -> list[int]:
        """Those of ``ranks`` still active that nothing came from for more than ``timeout``."""
        now = self.clock() if now is None else now
        return [r for r in ranks if r in self.active
                and now - self.last_seen.get(r, now) > self.timeout]

    def restore(self, state: dict, start: int) -> None:
        """The membership of a checkpoint at ``start``: active, lost, evaluators. A rank it
        still had active that the resume does not expect (another key-range shard had lost it
        by then: this one would have a round later) is lost at ``start``, and if it evaluated,
        the lowest live rank evaluates from ``start`` on, as ``lose`` would have done."""
        self.evaluators = state.get("evaluators", self.evaluators)
        self.lost = state["lost"]
        gone = sorted(set(state["active"]) - self.expected)
        self.active = set(state["active"]) & self.expected
        self.lost += [{"rank": r, "iter": start} for r in gone]
        if self.evaluators[-1]["rank"] in gone and self.active:
            self.evaluators.append({"rank": min(self.active), "from_iter": start})

    def lose(self, ranks: list[int], it: int | None, what: str,
             error: str | None = None) -> None:
        """Ranks are lost at iteration ``it`` (None: after the last one) while the server waited
        for ``what``; ``error`` is the cause when known (else: silence).

        Elastic, with someone left: they leave the active set and, if the evaluator is among
        them, the lowest live rank evaluates from then on. Otherwise RunAborted says who and why.
        """
        where = f"at iteration {it}" if it is not None else "after the last iteration"
        names = ", ".join(str(r) for r in ranks)
        if not self.elastic or len(self.active) - len(ranks) < 1:
            if error:
                raise RunAborted(f"rank {names} failed {where}: {error}", ranks)
            raise RunAborted(f"rank {names} stopped answering {where} (nothing for "
                             f"{self.timeout:g} s while waiting for {what})", ranks)
        evaluator = min(self.active)
        self.active -= set(ranks)
        self.lost += [{"rank": r, "iter": it} for r in ranks]
        self.log(f"elastic: lost rank {names} {where}; continuing with "
                 f"{len(self.active)} workers")
        if evaluator in ranks:  # the lowest live rank evaluates from this iteration's end on
            self.evaluators.append({"rank": min(self.active),
                                    "from_iter": self.iterations if it is None else it})
            self.log(f"elastic: rank {min(self.active)} evaluates from iteration "
                     f"{self.evaluators[-1]['from_iter']} on")


def _item(values: list, at: int):
    return values[at] if at < len(values) else "(none: the list ends)"


def _lookup(run: dict, field: str):
    """A run map's value at "numel" or "config.lr"."""
    for part in field.split("."):
        run = run.get(part) if isinstance(run, dict) else None
    return run
