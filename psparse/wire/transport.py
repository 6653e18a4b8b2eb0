"""Transport layer: ZeroMQ sockets, timeouts and byte accounting.

Knows nothing about message contents: it moves lists of byte frames and counts what they cost on
the wire. The server owns one ROUTER socket; each worker owns one DEALER socket connected to it.

Wire accounting. ZMTP 3 (the protocol ZeroMQ speaks over TCP) sends every frame as a flags byte, a
length field (1 byte for frames under 256 bytes, else 8 bytes) and the frame body. ROUTER routing
ids never leave the process (the ROUTER strips them before sending and adds them on receipt), so
the bytes a multipart message costs on the TCP stream are exactly ``wire_bytes(frames)``. TCP/IP
headers and the one-off connection handshake are not counted.
"""

from __future__ import annotations

import ipaddress
import socket as _socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

# A generous cap on any single incoming message; ZeroMQ drops the connection of a peer that sends
# more (ZMQ_MAXMSGSIZE), so no peer can make us allocate unbounded memory.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


def parse_rate(text: str) -> float:
    """Link rate in bits/s from ``"100Mbit"``, ``"1Gbit"``, ``"250M"``, ``"1e9"``."""
    t = str(text).strip().lower().removesuffix("bit/s").removesuffix("bps").removesuffix("bit")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"bandwidth {text!r}: expected a rate such as 100Mbit, 1Gbit, 5e8")
    return value


class Pacer:
    """Emulates a link of a given rate: traffic takes at least bytes*8/rate seconds.

    A virtual clock: each block of traffic occupies the link for bytes*8/rate seconds after
    whatever is still queued on it, and the caller sleeps until then. The server uses one for
    its link (see Server.link): the pushes of a round, then its broadcast, each as one block.
    """

    def __init__(self, bits_per_s: float):
        self.bytes_per_s = bits_per_s / 8.0
        self.free_at = 0.0

    def occupy(self, nbytes: int) -> None:
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + nbytes / self.bytes_per_s
        delay = self.free_at - now
        if delay > 0:
            time.sleep(delay)


class TransportTimeout(TimeoutError):
    """Nothing arrived within the allowed time."""


class PeerGone(ConnectionError):
    """A send to a peer whose connection has closed (the ROUTER refuses to route it).

    The layers above see this and ``TransportTimeout``, never ZeroMQ's own exceptions."""


_SNDMORE = int(zmq.SNDMORE)  # a plain int: enum arithmetic costs a small message's send ~10%


def frame_wire_bytes(length: int) -> int:
    """Bytes one ZMTP 3 frame of ``length`` body bytes occupies on the TCP stream."""
    return length + (2 if length < 256 else 9)


def wire_bytes(frames: Sequence) -> int:
    """Bytes a multipart message occupies on the wire (see module docstring)."""
    return sum(frame_wire_bytes(_nbytes(f)) for f in frames)


def _nbytes(frame) -> int:
    if isinstance(frame, (bytes, bytearray, zmq.Frame)):  # a Frame's len is its size
        return len(frame)
    nbytes = getattr(frame, "nbytes", None)  # numpy arrays and memoryviews
    return nbytes if nbytes is not None else memoryview(frame).nbytes


def is_loopback(address: str) -> bool:
    """True when a bind/connect host is a loopback address ("127.0.0.1", "localhost", "::1")."""
    if address in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(_socket.gethostbyname(address)).is_loopback
        except OSError:
            return False


class Channel:
    """One ZeroMQ socket with bounded waits and wire-byte counting.

    ``recv`` never blocks longer than the timeout it is given; ``send`` never blocks longer than
    ``send_timeout_s`` (a peer that stops reading fills its queue, and then we fail loudly rather
    than hang).
    """

    def __init__(self, sock: zmq.Socket, *, routed: bool):
        self.sock = sock
        self.ctx = sock.context
        self.routed = routed  # ROUTER: the first frame of every message is the peer's routing id
        self.sent_bytes = 0
        self.received_bytes = 0
        self.authenticator = None  # CurveZMQ: zmq.auth's authenticator thread, on the server


    @classmethod
    def server(cls, bind: str, port: int, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
               send_timeout_s: float = 60.0, curve_keys: str | Path | None = None) -> Channel:
        ctx = zmq.Context()  # one per channel: close() can then wait for queued sends
        sock = ctx.socket(zmq.ROUTER)
        _configure(sock, max_message_bytes, send_timeout_s)
        authenticator = _curve_server(ctx, sock, Path(curve_keys)) if curve_keys else None
        # Unroutable sends (a peer that went away) raise instead of being dropped silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port == 0:
                sock.bind_to_random_port(f"tcp://{_bracket(bind)}")
            else:
                sock.bind(f"tcp://{_bracket(bind)}:{port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            if authenticator:
                authenticator.stop()
            ctx.term()
            raise OSError(f"cannot bind tcp://{bind}:{port}: {exc}") from exc
        channel = cls(sock, routed=True)
        channel.authenticator = authenticator
        return channel

    @classmethod
    def client(cls, host: str, port: int, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
               send_timeout_s: float = 60.0, curve_keys: str | Path | None = None,
               key_name: str = "worker") -> Channel:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        _configure(sock, max_message_bytes, send_timeout_s)
        if curve_keys:
            _curve_client(sock, Path(curve_keys), key_name)
        sock.connect(f"tcp://{_bracket(host)}:{port}")
        return cls(sock, routed=False)

    @property
    def port(self) -> int:
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return int(endpoint.rsplit(":", 1)[1])

    def send(self, frames: Sequence, peer: bytes | None = None) -> int:
        """Send one multipart message (zero-copy for large frames); returns its wire bytes."""
        parts = [peer, *frames] if self.routed else frames
        try:
            # send_multipart's loop without its flag arithmetic; zero-copy above pyzmq's copy
            # threshold, copied below it, as send_multipart does
            sock, last = self.sock, len(parts) - 1
            for n, part in enumerate(parts):
                sock.send(part, _SNDMORE if n < last else 0, copy=False)
        except zmq.Again as exc:
            raise TransportTimeout("send timed out: the peer is not reading") from exc
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: no connection to that peer any more
            raise PeerGone(f"the peer's connection is closed ({exc})") from exc
        n = wire_bytes(frames)
        self.sent_bytes += n
        return n

    def recv(self, timeout_s: float):
        """Wait up to ``timeout_s`` for one message.

        Returns ``(peer, frames, wire_bytes)`` (``peer`` is None on a DEALER) or None on timeout.
        Frames are ``zmq.Frame`` objects whose ``.buffer`` can be viewed without a copy.
        """
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        parts = self.sock.recv_multipart(copy=False)
        peer = None
        if self.routed:
            peer, parts = parts[0].bytes, parts[1:]
        n = wire_bytes(parts)
        self.received_bytes += n
        return peer, parts, n

    def close(self, linger_s: float = 2.0) -> None:
        """Close, first giving queued messages up to ``linger_s`` to leave (a final shutdown
        message must reach the workers even if this process exits right after)."""
        self.sock.close(linger=int(linger_s * 1000))
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()


# CurveZMQ key layout made by `psparse-keys DIR` (zmq.auth certificate files):
#   DIR/server.key, DIR/server.key_secret      the server's key pair
#   DIR/worker-R.key, DIR/worker-R.key_secret  one pair per worker rank (or worker.key*)
#   DIR/authorized/*.key                       public keys the server accepts
def _curve_server(ctx: zmq.Context, sock: zmq.Socket, keys: Path):
    from zmq.auth.thread import ThreadAuthenticator

    public, secret = _load_pair(keys / "server.key_secret")
    authorized = keys / "authorized"
    if not authorized.is_dir():
        raise OSError(f"{authorized} is missing: run psparse-keys {keys}")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = public, secret
    return auth


def _curve_client(sock: zmq.Socket, keys: Path, key_name: str) -> None:
    import zmq.auth

    own = keys / f"{key_name}.key_secret"
    if not own.is_file():
        own = keys / "worker.key_secret"
    public, secret = _load_pair(own)
    server_public, _ = zmq.auth.load_certificate(str(_exists(keys / "server.key")))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = server_public


def _load_pair(path: Path):
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(_exists(path)))
    if secret is None:
        raise OSError(f"{path} holds no secret key")
    return public, secret


def _exists(path: Path) -> Path:
    if not path.is_file():
        raise OSError(f"CurveZMQ key file {path} not found (create keys with psparse-keys)")
    return path


def create_keys(keys: Path, workers: int) -> list[Path]:
    """Server key pair, one pair per worker rank, and the authorized/ folder of public keys."""
    import shutil

    import zmq.auth

    keys.mkdir(parents=True, exist_ok=True)
    (keys / "authorized").mkdir(exist_ok=True)
    made = [Path(p) for p in zmq.auth.create_certificates(str(keys), "server")]
    for rank in range(workers):
        public, secret = zmq.auth.create_certificates(str(keys), f"worker-{rank}")
        shutil.copy(public, keys / "authorized")
        made += [Path(public), Path(secret)]
    for path in made:
        if path.name.endswith("_secret"):
            path.chmod(0o600)
    return made


def _configure(sock: zmq.Socket, max_message_bytes: int, send_timeout_s: float) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 200)
    # Unbounded queues: flow control comes from the synchronous round structure, not from HWMs
    # (a dropped aggregate would desynchronise replicas).
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def warn(msg: str) -> None:
    print(f"psparse: warning: {msg}", file=sys.stderr, flush=True)
