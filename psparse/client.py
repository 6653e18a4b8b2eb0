"""The worker's side of the wire: a parameter-server client (docs/protocol.md).

``PSClient`` holds one worker's connection to the server and speaks the protocol for it:
registration (with the run token's proof), heartbeats on their own connection, the messages of
a round (``propose`` → ``indices``, ``push`` → ``aggregate``), evaluation reports, the final
report and the error report of a worker that gives up. It knows nothing of models, policies or
training: ``psparse.session`` drives it. Transport failures arrive here as ``TransportTimeout``
/ ``PeerGone`` and leave as ``ServerGone``; nothing above this module sees ZeroMQ.
"""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np

from . import protocol
from .codec import KeyCache
from .protocol import ProtocolError
from .transport import Channel, PeerGone, TransportTimeout


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
                 curve_keys: str | None = None, run_token: str | None = None):
        self.host, self.port = host, port
        self.rank, self.world_size, self.numel = rank, world_size, numel
        self.timeout = timeout
        self.curve_keys = curve_keys
        self.run_token = run_token  # proves this worker belongs to the run (register's HMAC)
        self.index_dtype = np.dtype(protocol.index_dtype_for(numel))
        self.cache = KeyCache()  # index sets this worker and the server both hold
        self.heartbeat: Heartbeat | None = None
        self.sent_bytes = 0  # wire bytes of pushes and proposals (the worker's upload)
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
            _, frames, nbytes = got
            try:
                msg = protocol.decode(frames, numel=self.numel, cache=self.cache)
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

    # ------------------------------------------------------------------------- registration
    def register(self, run: dict, checksum: str, start: int) -> protocol.Message:
        """Register (proving the run token if there is one), wait for ``ready``, start the
        heartbeat; returns ``ready`` (it carries the agreed run)."""
        proof = {}
        if self.run_token:
            nonce = secrets.token_hex(16)
            proof = {"nonce": nonce, "proof": protocol.register_proof(
                self.run_token, self.rank, self.world_size, nonce)}
        self.send(protocol.encode("register", rank=self.rank, world_size=self.world_size,
                                  run=run, checksum=checksum, start=start, **proof))
        ready = self.expect("ready", "the ready signal (all workers registered)")
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
            model_size=self.numel, cache=self.cache, iter=it, rank=self.rank))
        msg = self.expect("indices", f"the group's indices of iteration {it}", it)
        self.received_bytes += msg.extra["nbytes"]
        return msg.indices

    def push(self, it: int, indices: np.ndarray, values: np.ndarray, loss: float | None,
             checksum: str | None, dense_buffer: np.ndarray | None = None) -> protocol.Message:
        """Send this round's (index, value) pairs, dense when that is smaller (SparCML's
        switch, into ``dense_buffer``); returns the aggregate."""
        extra = {"checksum": checksum} if checksum else {}
        if loss is not None:
            extra["loss"] = loss
        if protocol.dense_is_smaller(indices.size, self.numel, self.index_dtype.name):
            dense = dense_buffer if dense_buffer is not None else \
                np.empty(self.numel, dtype=np.float32)
            dense[:] = 0.0
            dense[indices] = values
            frames = protocol.encode("push", None, dense, iter=it, rank=self.rank, dense=True,
                                     **extra)
        else:
            frames = protocol.encode("push", indices.astype(self.index_dtype, copy=False), values,
                                     model_size=self.numel, cache=self.cache, iter=it,
                                     rank=self.rank, **extra)
        self.sent_bytes += self.send(frames)
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
        self.expect("shutdown", "the end-of-run shutdown")

    def give_up(self, cause: str) -> None:
        """Tell the server why this worker stops, and wait (briefly) for its acknowledging
        shutdown, so that the cause is in summary.json before this process exits."""
        try:
            self.channel.send(protocol.encode("error", message=cause, rank=self.rank))
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

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        self.channel.close()
