"""The worker's side of the wire: a parameter-server client (docs/protocol.md).

``PSClient`` holds one worker's connection to the server and speaks the protocol for it:
registration (with the run token's proof), heartbeats on their own connection, the messages of a
round (``propose`` → ``indices``, ``push`` → ``aggregate``), evaluation reports, the final report
and the error report of a worker that gives up. It knows nothing of models, policies or training:
``psparse.worker.session`` drives it (``psparse.worker.sharded_client.ShardedClient`` with the same
interface when the run has S key-range server shards). Transport failures arrive here as
``TransportTimeout`` / ``PeerGone`` and leave as ``ServerGone``; nothing above this module sees
ZeroMQ.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time

import numpy as np

from ..ops.codec.codec import KeyCache
from ..ops.values.formats import FP32, ValueFormat
from ..wire import protocol, run_description
from ..wire.protocol import ProtocolError
from ..wire.transport import Channel, PeerGone, TransportTimeout
from .frames import merge_aggregates, push_frames


class WorkerError(RuntimeError):
    """This worker cannot go on; the text says why."""


class ServerGone(WorkerError):
    """The server ended the run or cannot be reached: there is nobody to report a cause to."""


class Heartbeat(threading.Thread):
    """Tells the server this worker is alive while it computes, evaluates or waits.

    Its own connection (ZeroMQ sockets are not thread-safe), carrying the rank and the token the
    server handed out in "ready", so nobody else can keep a rank alive. A frozen or killed
    process stops beating and the server declares it lost after --timeout.
    """

    def __init__(self, host: str, port: int, rank: int, token: str, interval: float,
                 curve_keys: str | None):
        super().__init__(name=f"heartbeat-{rank}", daemon=True)
        self.channel = Channel.client(host, port, send_timeout_s=interval,
                                      curve_keys=curve_keys, key_name=f"worker-{rank}")
        self.beat = protocol.encode("heartbeat", rank=rank, token=token)
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.channel.send(self.beat)
                self._stop_event.wait(self.interval)
        except (TransportTimeout, PeerGone):
            pass  # the server is gone; the main thread notices through its own timeout

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2 * self.interval)
        self.channel.close(linger_s=0)


class PSClient:
    """One worker's connection to the server, and the protocol's messages on it."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, numel: int,
                 timeout: float = 30.0, max_message_bytes: int = 1 << 30,
                 curve_keys: str | None = None, run_token: str | None = None,
                 shard: tuple[int, int] | None = None):
        self.host, self.port = host, port
        self.shard = shard  # [I, S] in the register when the server is a key-range shard
        self.rank, self.world_size, self.numel = rank, world_size, numel
        self.timeout = timeout
        self.curve_keys = curve_keys
        self.run_token = run_token  # proves this worker belongs to the run (register's HMAC)
        self.index_dtype = np.dtype(protocol.index_dtype_for(numel))
        self.cache = KeyCache()  # index sets this worker and the server both hold
        self.parts: np.ndarray | None = None  # a round in parts: the key ranges' boundaries
        self.part_caches: list[KeyCache] = []  # ... and one key cache per part
        self.heartbeat: Heartbeat | None = None
        self.stop_requested = False  # ps.stop(): every push from now on asks to end the run
        self.heard = False  # anything came from the server (it is there)
        self.ready = False  # its ready came: registered, training
        self.sent_bytes = 0  # wire bytes of pushes and proposals (the worker's upload)
        # the agreed run's value format (--values; set by ready), and where the rounding error
        # of a push goes: feedback(global indices, error), the memory's feed_back
        self.value_format: ValueFormat = FP32
        self.feedback = None
        self.key_offset = 0  # this connection's first key (a key-range shard's edge)
        self.received_bytes = 0  # wire bytes of aggregates and index messages
        try:
            self.channel = Channel.client(host, port, send_timeout_s=timeout,
                                          max_message_bytes=max_message_bytes,
                                          curve_keys=curve_keys, key_name=f"worker-{rank}")
        except OSError as exc:
            raise WorkerError(str(exc)) from None

    # ------------------------------------------------------------------------------- basics
    def send(self, frames) -> int:
        try:
            return self.channel.send(frames)
        except (TransportTimeout, PeerGone) as exc:
            raise ServerGone(f"lost the server: {exc}") from None

    def expect(self, msg_type: str, what: str, it: int | None = None) -> protocol.Message:
        """Wait for the server's next ``msg_type``; server errors and shutdowns end the run."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            got = self.channel.recv(remaining) if remaining > 0 else None
            if got is None:
                raise ServerGone(f"no {what} from the server within {self.timeout:g} s "
                                 "(server gone or stalled)")
            self.heard = True
            _, frames, nbytes = got
            try:
                msg = protocol.decode(frames, numel=self.numel, cache=self.cache) \
                    if self.parts is None else protocol.decode(frames, scope=self._part_scope)
            except ProtocolError as exc:
                raise WorkerError(f"malformed message from the server: {exc}") from None
            if msg.type == "heartbeat":  # the server is alive, just waiting for others
                deadline = time.monotonic() + self.timeout
                continue
            if msg.type == "error":
                raise WorkerError(f"the server rejected our message: {msg['message']}")
            if msg.type == "shutdown":
                if msg["ok"] and msg_type == "shutdown":
                    return msg
                raise ServerGone(f"the server ended the run: {msg['reason']}")
            if msg.type != msg_type or (it is not None and msg["iter"] != it):
                raise WorkerError(f"expected {what}, got {msg.type} "
                                  f"{msg.get('iter', '')}".rstrip())
            msg.extra["nbytes"] = nbytes
            return msg

    # -------------------------------------------------------------------------------- parts
    def use_parts(self, edges) -> None:
        """Exchange every round in parts (docs/protocol.md, Parts): part p holds keys
        [edges[p], edges[p + 1]), in part-relative indices, with its own key cache."""
        self.parts = np.asarray(edges, dtype=np.int64)
        self.part_caches = [KeyCache() for _ in range(len(edges) - 1)]

    def _part_scope(self, header):
        """decode's scope: an aggregate's part sets its size and key cache."""
        if header.get("type") != "aggregate":
            return self.numel, None
        part = header.get("part")
        if part is None or part >= len(self.part_caches):
            raise ProtocolError(f"aggregate of part {part}, the run has "
                                f"{len(self.part_caches)} parts")
        return int(self.parts[part + 1] - self.parts[part]), self.part_caches[part]

    def send_part(self, it: int, part: int, indices: np.ndarray, values: np.ndarray,
                  loss: float | None = None, checksum: str | None = None,
                  overflow: bool = False) -> None:
        """Push part ``part`` of iteration ``it``: ``indices`` are global keys in its range.
        ``overflow``: this part's gradient is not finite (no entries; docs/protocol.md,
        Overflow): the server flags the part's aggregate, and every rank skips the step."""
        lo, hi = int(self.parts[part]), int(self.parts[part + 1])
        size = hi - lo
        local = np.asarray(indices, dtype=np.int64) - lo
        self.sent_bytes += self.send(push_frames(
            it, self.rank, local, values, size, self.part_caches[part], loss, checksum,
            part=part, overflow=overflow, stop=self.stop_requested,
            value_format=self.value_format, feedback=self._feedback_at(lo)))

    def await_parts(self, it: int) -> protocol.Message:
        """Every part's aggregate of iteration ``it`` (they come in the order the server
        completes them), merged into one aggregate over the whole vector, global indices."""
        got: dict[int, protocol.Message] = {}
        while len(got) < len(self.part_caches):
            msg = self.await_aggregate(it)
            if msg["part"] in got:
                raise WorkerError(f"the server sent part {msg['part']} of iteration {it} twice")
            got[msg["part"]] = msg
        merged = merge_aggregates([got[p] for p in range(len(got))], self.parts)
        merged.header.pop("part", None)
        return merged

    # ------------------------------------------------------------------------- registration
    def register(self, run: dict, checksum: str, start: int) -> protocol.Message:
        """Register (proving the run token if there is one), wait for ``ready``, start the
        heartbeat; returns ``ready`` (it carries the agreed run)."""
        self.send_register(run, checksum, start)
        return self.await_ready()

    def send_register(self, run: dict, checksum: str, start: int) -> None:
        proof = {}
        if self.run_token:
            nonce = secrets.token_hex(16)
            proof = {"nonce": nonce, "proof": run_description.register_proof(
                self.run_token, self.rank, self.world_size, nonce)}
        if self.shard is not None:
            proof["shard"] = list(self.shard)
        self.send(protocol.encode("register", rank=self.rank, world_size=self.world_size,
                                  run=run, checksum=checksum, start=start, **proof))

    def await_ready(self) -> protocol.Message:
        try:
            ready = self.expect("ready", "the ready signal (all workers registered)")
        except ServerGone as exc:
            if self.heard:
                raise
            raise ServerGone(
                f"no answer from a psparse server at {self.host}:{self.port} within "
                f"{self.timeout:g} s: start psparse-server (or run under psparse-launch), or "
                "point the worker at it: connect(server='host:port'), PSPARSE_SERVER=host:port, "
                "or MASTER_ADDR with PSPARSE_PORT") from exc
        self.ready = True
        self.value_format, _ = run_description.run_value_format(ready["run"])
        if ready["heartbeat_s"] > 0:
            self.heartbeat = Heartbeat(self.host, self.port, self.rank, ready["token"],
                                       ready["heartbeat_s"], self.curve_keys)
            self.heartbeat.start()
        return ready

    # -------------------------------------------------------------------------------- rounds
    def propose(self, it: int, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Phase 1 of a two-phase round: send the proposal, get the group's indices."""
        self.sent_bytes += self.send(protocol.encode(
            "propose", indices.astype(self.index_dtype, copy=False), values,
            model_size=self.numel, cache=self.cache, value_format=self.value_format, iter=it,
            rank=self.rank))
        msg = self.expect("indices", f"the group's indices of iteration {it}", it)
        self.received_bytes += msg.extra["nbytes"]
        return msg.indices

    def push(self, it: int, indices: np.ndarray, values: np.ndarray, loss: float | None,
             checksum: str | None, dense_buffer: np.ndarray | None = None,
             overflow: bool = False) -> protocol.Message:
        """Send this round's (index, value) pairs, dense when that is smaller (SparCML's
        switch, into ``dense_buffer``); returns the aggregate. ``overflow``: this worker's
        gradient is not finite (nothing sent; every worker skips the step, psparse.worker.amp)."""
        self.send_push(it, indices, values, loss, checksum, dense_buffer, overflow)
        return self.await_aggregate(it)

    def send_propose(self, it: int, indices: np.ndarray, values: np.ndarray) -> None:
        self.sent_bytes += self.send(protocol.encode(
            "propose", indices.astype(self.index_dtype, copy=False), values,
            model_size=self.numel, cache=self.cache, value_format=self.value_format, iter=it,
            rank=self.rank))

    def await_candidates(self, it: int) -> protocol.Message:
        """A key-range shard's answer to a proposal: its best indices with their scores."""
        msg = self.expect("candidates", f"the shard's candidates of iteration {it}", it)
        self.received_bytes += msg.extra["nbytes"]
        return msg

    def send_push(self, it: int, indices: np.ndarray, values: np.ndarray, loss: float | None,
                  checksum: str | None, dense_buffer: np.ndarray | None = None,
                  overflow: bool = False) -> None:
        self.sent_bytes += self.send(push_frames(
            it, self.rank, indices, values, self.numel, self.cache, loss, checksum,
            dense_buffer=dense_buffer, overflow=overflow, stop=self.stop_requested,
            value_format=self.value_format, feedback=self._feedback_at(0)))

    def _feedback_at(self, offset: int):
        """push_frames' feedback for indices local to a range starting at key ``offset`` of
        this connection (a part's first key), or None (float32 values, or no memory)."""
        if self.feedback is None or self.value_format.exact:
            return None
        offset += self.key_offset
        if offset == 0:
            return self.feedback
        return lambda local, error: self.feedback(np.asarray(local, np.int64) + offset, error)

    def await_aggregate(self, it: int) -> protocol.Message:
        agg = self.expect("aggregate", f"the aggregate of iteration {it}", it)
        self.received_bytes += agg.extra["nbytes"]
        return agg

    # ----------------------------------------------------------------------- reports, ending
    def report(self, it: int, values: dict, checksum: str | None = None) -> None:
        extra = {"checksum": checksum} if checksum else {}
        self.send(protocol.encode("metrics", iter=it, rank=self.rank, report=values, **extra))

    def finish(self, it: int, values: dict, checksum: str) -> None:
        """The final report, then the server's end-of-run shutdown."""
        self.report(it, {**values, "final": True}, checksum)
        self.await_shutdown()

    def await_shutdown(self) -> None:
        self.expect("shutdown", "the end-of-run shutdown")

    def cache_state(self):
        if self.parts is not None:
            return {"parts": [c.state() for c in self.part_caches]}
        return self.cache.state()

    def restore_cache(self, state) -> None:
        if self.parts is not None:
            if not (isinstance(state, dict) and "parts" in state
                    and len(state["parts"]) == len(self.part_caches)):
                raise WorkerError("the checkpoint's key caches are not for this run's buckets "
                                  "(resume with the same --overlap / --bucket-mb)")
            for c, part in zip(self.part_caches, state["parts"]):
                c.restore(part)
            return
        self.cache.restore(state)

    def give_up(self, cause: str) -> None:
        """Tell the server why this worker stops, and wait (briefly) for its acknowledging
        shutdown, so that the cause is in summary.json before this process exits."""
        proof = {}
        if not self.ready and self.run_token:  # before ready: the run token proves the rank
            nonce = secrets.token_hex(16)
            proof = {"nonce": nonce, "proof": run_description.error_proof(self.run_token, self.rank,
                                                                   nonce)}
        try:
            self.channel.send(protocol.encode("error", message=cause, rank=self.rank, **proof))
        except (TransportTimeout, PeerGone):
            return
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while (remaining := deadline - time.monotonic()) > 0:
            got = self.channel.recv(remaining)
            if got is None:
                return
            try:
                if protocol.decode(got[1], numel=self.numel).type == "shutdown":
                    return
            except ProtocolError:
                continue  # e.g. an index set cached on a connection we no longer track

    def request_stop(self) -> None:
        """Ask, with every push from now on, to end the run with that round."""
        self.stop_requested = True

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        self.channel.close()


def report_failure(servers: list[tuple[str, int]], rank: int, world_size: int, cause: str, *,
                   run_token: str | None, curve_keys: str | None = None,
                   timeout: float = 5.0) -> None:
    """A worker that failed before it could register tells every server why (an ``error``
    proving the run token), so that summary.json names the cause; waits briefly for the
    acknowledging shutdown, and gives up quietly if nobody answers."""
    for host, port in servers:
        try:  # nobody listening there: nobody to tell (and no reason to wait for an answer)
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError:
            continue
        try:
            client = PSClient(host, port, rank, world_size, numel=1, timeout=timeout,
                              curve_keys=curve_keys, run_token=run_token)
        except WorkerError:
            continue
        try:
            client.give_up(cause)
        finally:
            client.channel.close(linger_s=0.5)
