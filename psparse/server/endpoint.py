"""The server's socket: bounded waits, heartbeats, decoding, refusals, sends and broadcasts.

The server's socket and what it says on it: bounded waits with heartbeats, every message
decoded and authenticated before anyone reads it, answers to bad messages, sends and
broadcasts (with each connection's key cache), the emulated link's pacing.

Nothing here knows rounds or files: ``psparse.server.rounds`` asks for messages and sends
through an ``Endpoint``; who is in the run is ``psparse.server.membership.Membership``'s.
"""

from __future__ import annotations

import time

from ..ops.codec.codec import KeyCache
from ..wire import protocol
from ..wire.protocol import ProtocolError
from ..wire.transport import Channel, Pacer, PeerGone, TransportTimeout, wire_bytes
from .membership import RunAborted


class Endpoint:
    """One ROUTER socket and the run's members behind it."""

    def __init__(self, channel: Channel, members, *, timeout: float, log, records):
        self.channel, self.members, self.log = channel, members, log
        self.records = records  # counts the rejected messages
        self.timeout = timeout
        self.last_value_bytes = 0  # the last broadcast's value frames, summed over workers
        self.heartbeat_s = timeout / 5  # several beats fit in one timeout
        self.patience = 10  # a wait ends after 10 x timeout even if everyone heartbeats
        self.link: Pacer | None = None  # --bandwidth emulation of the server's link
        self._last_heartbeat = 0.0
        self.wait_start = time.monotonic()
        self.numel = 0
        self.parts: list[int] | None = None
        self.caches: dict = {}  # per connection (and part): the index sets both ends hold
        self.closed_hint = ""  # added to "its connection closed" (the server's finish sets it)

    def configure(self, numel: int, parts: list[int] | None, world_size: int) -> None:
        """The agreed run's size and parts: what messages are decoded against, and one key
        cache per worker (per worker and part)."""
        self.numel, self.parts = numel, parts
        self.caches = {r: KeyCache() for r in range(world_size)} if parts is None \
            else {(r, p): KeyCache() for r in range(world_size) for p in range(len(parts) - 1)}

    @property
    def port(self) -> int:
        return self.channel.port

    def deadline(self) -> float:
        """A wait's end: patience x timeout from now, whatever the heartbeats say."""
        self.wait_start = time.monotonic()
        return self.wait_start + self.timeout * self.patience

    def wait(self, what, deadline: float, waiting_for=(), it: int | None = None):
        """Next message as (peer, frames, nbytes).

        Ranks in ``waiting_for`` are declared lost once nothing (message or heartbeat) came from
        them for ``timeout`` seconds (then None); ``deadline`` bounds the whole wait in any
        case, so a worker that heartbeats but never sends cannot hang the run either.
        ``what`` names what is awaited, for those messages: a string, or a function that makes
        it (a round waits for every push: it is made only when someone is lost).
        """
        members = self.members
        while True:
            now = time.monotonic()
            lost = members.silent(waiting_for, now)
            if lost:
                members.lose(lost, it, what() if callable(what) else what)
                return None
            if now >= deadline:
                raise RunAborted(f"timed out after {deadline - self.wait_start:.0f} s waiting "
                                 f"for {what() if callable(what) else what}")
            if self.heartbeat_s and now - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = now  # tell waiting workers the server is alive
                if self._beat(it, what() if callable(what) else what):
                    return None
            step = min(deadline - now, self.heartbeat_s or deadline - now, 0.5)
            got = self.channel.recv(max(step, 0.0))
            if got is not None:
                members.seen(got[0])
                return got

    def _beat(self, it, what) -> bool:
        """A heartbeat to every connected worker; True when one turned out to be gone."""
        members = self.members
        beat = protocol.encode("heartbeat")
        gone = []
        for r in members.connected():
            try:
                self.channel.send(beat, members.rank_peer[r])
            except PeerGone:  # ROUTER_MANDATORY: this peer's connection closed
                if members.training:
                    gone.append(r)
                else:  # registered, then left: free the rank
                    members.unbind(r, "its connection closed")
            except TransportTimeout:
                pass  # connected but not reading: silence decides, in wait
        if gone:
            members.lose(gone, it, what,
                         "its connection closed (the worker has gone)" + self.closed_hint)
        return bool(gone)

    def reachable(self, peer: bytes) -> bool:
        """Whether a peer's connection is still open (ROUTER_MANDATORY refuses a send to a peer
        that has gone); probes with a heartbeat, which workers ignore."""
        try:
            self.channel.send(protocol.encode("heartbeat"), peer)
        except PeerGone:
            return False
        except TransportTimeout:
            pass  # connected, just not reading yet
        return True

    # ---------------------------------------------------------------------------- receiving
    def accept(self, peer: bytes, frames) -> protocol.Message | None:
        """Decode and authenticate a message from a registered worker; None if rejected (or a
        heartbeat).

        The header is read and checked first; then, before any other frame is read (a frame's
        size fields could ask for any amount of memory), the sender must be a registered
        worker still in the run, speaking for its own rank (heartbeats, which may come on any
        connection, prove their rank's token instead); then the frames are decoded and checked.
        """
        rank = self.members.peers.get(peer)

        def admit(msg: protocol.Message) -> None:
            if msg.type != "heartbeat":
                self.members.sender(peer, msg)

        try:
            # key cache: look sets up now, remember them only once accepted (docs/protocol.md)
            if self.parts is not None:
                msg = protocol.decode(frames, remember=False, scope=self._part_scope(rank),
                                      admit=admit)
            else:
                msg = protocol.decode(frames, numel=self.numel, remember=False,
                                      cache=self.caches[rank] if rank is not None else None,
                                      admit=admit)
            if msg.type == "heartbeat":
                self.members.heartbeat(msg)
                return None  # heartbeats are never answered
            return msg
        except ProtocolError as exc:
            self.reject(peer, exc)
            return None

    def _part_scope(self, rank: int | None):
        """decode's scope for a run in parts: a push's part sets its size and key cache."""
        def scope(header):
            if header.get("type") not in ("push",):
                return self.numel, None
            part = header.get("part")
            if part is None:
                raise ProtocolError("this run is exchanged in parts (its run has 'parts'): "
                                    "a push must carry 'part'")
            if part >= len(self.parts) - 1:
                raise ProtocolError(f"push for part {part}, the run has "
                                    f"{len(self.parts) - 1} parts")
            cache = self.caches[(rank, part)] if rank is not None else None
            return self.parts[part + 1] - self.parts[part], cache
        return scope

    def remember(self, msg: protocol.Message) -> None:
        """An accepted push's index set, now held by both ends (read-only: the cache keeps it
        without a copy)."""
        if msg.indices is None:
            return
        msg.indices.flags.writeable = False
        part = msg.get("part")
        self.caches[msg["rank"] if part is None else (msg["rank"], part)].remember(
            msg.indices, sent=False)

    # ------------------------------------------------------------------------------ sending
    def reject(self, peer: bytes, exc: Exception) -> None:
        """Answer a bad message with an error naming the problem; log the first few."""
        self.records.rejected += 1
        rejected = self.records.rejected
        if rejected <= 20 or rejected % 1000 == 0:
            peers = self.members.peers
            who = f"rank {peers[peer]}" if peer in peers else "unregistered peer"
            self.log(f"rejected message #{rejected} from {who}: {exc}")
        try:
            self.channel.send(protocol.encode("error", message=str(exc)), peer)
        except (PeerGone, TransportTimeout):
            pass  # the peer is gone or not reading; nothing else to do for it

    def send(self, peer: bytes, frames, it: int | None = None) -> int:
        """Send to a worker; one whose connection has closed is lost (dropped from an elastic
        run, else the run ends naming it). Returns the wire bytes (0 if not sent)."""
        rank = self.members.peers.get(peer)
        try:
            return self.channel.send(frames, peer)
        except PeerGone as exc:
            cause = f"its connection closed (a send to it failed: {exc})"
        except TransportTimeout as exc:
            cause = str(exc)
        self.members.lose([rank], it, "a send", cause)
        return 0

    def try_send(self, peer: bytes, frames) -> None:
        try:
            self.channel.send(frames, peer)
        except (PeerGone, TransportTimeout):
            pass  # that peer is gone already; the others still hear about it

    def broadcast(self, msg_type: str, indices, values, model_size: int | None = None,
                  **fields) -> int:
        """Send one message to every live worker; its wire bytes summed over workers.

        Encoded per worker: each connection's key cache knows different sets (a run in parts
        keeps one per connection and part); the index frame itself is encoded once.
        """
        ranks = sorted(self.members.active)
        part = fields.get("part")
        shared: dict = {}  # the index frame encoded once, one copy of the set for every cache
        messages = [protocol.encode(msg_type, indices, values,
                                    model_size=model_size or self.numel,
                                    cache=self.caches[r if part is None else (r, part)],
                                    shared=shared, **fields) for r in ranks]
        if self.link is not None:
            self.pace(sum(wire_bytes(m) for m in messages))
        # the value frames' share of it (metrics.jsonl's index/value split)
        self.last_value_bytes = sum(memoryview(m[2]).nbytes for m in messages) \
            if msg_type in protocol.SPARSE_TYPES else 0
        return sum(self.send(self.members.rank_peer[r], m, it=fields.get("iter"))
                   for r, m in zip(ranks, messages))

    def shutdown(self, ok: bool, reason: str) -> None:
        """The end of the run, told to every worker still connected."""
        frames = protocol.encode("shutdown", ok=ok, reason=reason)
        for rank in self.members.connected():
            self.try_send(self.members.rank_peer[rank], frames)

    def pace(self, nbytes: int) -> None:
        """With --bandwidth: hold the round as long as the server's link would need for nbytes.

        Pushes arrive (and broadcasts leave) as one block: on a real link the N flows share the
        server's bandwidth and all finish together, after N * size / rate. So every worker
        receives the broadcast at the same moment, as on a cluster, and the emulation matches
        psparse-model's additive form (compute + upload + broadcast).
        """
        if self.link is not None:
            self.link.occupy(nbytes)
