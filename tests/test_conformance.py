"""Protocol conformance: a worker written from docs/protocol.md alone joins a real run.

The client below (``SpecWorker``) imports nothing from psparse: only pyzmq, msgpack, numpy and
the standard library. It plays one rank beside a real ``psparse-worker`` against a real
``psparse-server`` (run token on), adopts the run (no ``run``, no ``checksum``: it cannot
reproduce torch's arithmetic), heartbeats, picks its own indices (top-k of a local
error-feedback accumulator fed with tiny pseudo-gradients), sends them in all four index formats,
decodes whatever the server sends, sends the final report and expects ``shutdown(ok=true)``.
Negative checks: a register with a wrong proof, a heartbeat with a wrong token, a push above
``push_max``, a dense push under a sparse budget and (two-phase) a proposal above
``propose_max`` each get an ``error`` reply and change nothing (the run still ends ok, and
``metrics.jsonl`` records only the corrected pushes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

# ------------------------------------------------------------------------------------------
# The client (docs/protocol.md, version 2)
# ------------------------------------------------------------------------------------------

V = 2
INT, NUM, BOOL, STR, MAP, LIST = "int", "num", "bool", "str", "map", "list"
# server -> worker messages: field -> (type, required); frame counts
S2W = {
    "ready": ({"world_size": (INT, 1), "start": (INT, 1), "run": (MAP, 1), "token": (STR, 1),
               "heartbeat_s": (NUM, 1)}, 1),
    "indices": ({"iter": (INT, 1), "count": (INT, 1), "index_dtype": (STR, 1),
                 "index_format": (STR, 0)}, 2),
    "aggregate": ({"iter": (INT, 1), "count": (INT, 1), "index_dtype": (STR, 1),
                   "value_dtype": (STR, 1), "workers": (INT, 1), "dense": (BOOL, 0),
                   "index_format": (STR, 0), "live": (LIST, 0)}, 3),
    "shutdown": ({"ok": (BOOL, 1), "reason": (STR, 1)}, 1),
    "error": ({"message": (STR, 1), "iter": (INT, 0), "rank": (INT, 0)}, 1),
    "heartbeat": ({"rank": (INT, 0), "token": (STR, 0)}, 1),
}
DTYPES = {"int32": "<i4", "int64": "<i8"}


class ProtocolViolation(AssertionError):
    """The server sent something docs/protocol.md does not allow."""


class RunAborted(RuntimeError):
    """shutdown(ok=false) arrived."""


def _is(value, kind) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {BOOL: bool, STR: str, MAP: dict, LIST: list}[kind])


def pack(header: dict) -> bytes:
    return msgpack.packb({"v": V, **header}, use_bin_type=True)


def cache_key(idx: np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(idx, "<i8").tobytes(), digest_size=8).digest()


def register_proof(token: str, rank: int, world: int, nonce: str) -> str:
    msg = f"psparse-register-v2\n{rank}\n{world}\n{nonce}"
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def leb128(idx: np.ndarray) -> bytes:
    out = bytearray()
    prev = None
    for i in idx.tolist():
        n = i if prev is None else i - prev
        prev = i
        while True:
            b = n & 0x7F
            n >>= 7
            out.append(b | (0x80 if n else 0))
            if not n:
                break
    return bytes(out)


def unleb128(data: bytes) -> list[int]:
    vals, cur, shift, nbytes = [], 0, 0, 0
    for b in data:
        cur |= (b & 0x7F) << shift
        shift += 7
        nbytes += 1
        if nbytes > 10:
            raise ProtocolViolation("varint longer than 10 bytes")
        if not b & 0x80:
            vals.append(cur)
            cur, shift, nbytes = 0, 0, 0
    if nbytes:
        raise ProtocolViolation("truncated varint")
    return vals


class SpecWorker:
    """One rank, adopting the run, opted out of checksums."""

    def __init__(self, endpoint: str, rank: int, world: int, token: str | None,
                 silence_s: float = 20.0, seed: int = 1):
        self.endpoint, self.rank, self.world, self.token = endpoint, rank, world, token
        self.silence_s = silence_s
        self.ctx = zmq.Context()
        self.main = self._dealer()
        self.rng = np.random.default_rng(seed)
        self.last_sent: np.ndarray | None = None   # key caching (Index frames)
        self.last_recv: np.ndarray | None = None
        self.log: list[str] = []
        self.errors_seen: list[dict] = []
        self.hb_errors: list[dict] = []
        self.hb_stop = threading.Event()
        self.hb_thread: threading.Thread | None = None
        self.sent_counts: dict[int, int] = {}
        self.seen: dict[str, int] = {}  # received index formats / server heartbeats, by name

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(self.endpoint)
        return s

    # -- wire -------------------------------------------------------------------------------
    def send(self, header: dict, *frames: bytes) -> None:
        self.main.send_multipart([pack(header), *frames])

    def recv(self, want: set[str]) -> tuple[dict, list[bytes]]:
        """Next message of a type in ``want`` (heartbeats skipped; silence bounded)."""
        while True:
            if not self.main.poll(int(self.silence_s * 1000)):
                raise TimeoutError(f"server silent for {self.silence_s}s waiting for {want}")
            frames = self.main.recv_multipart()
            h = self.check(frames)
            t = h["type"]
            if t == "heartbeat":
                self.seen["heartbeat"] = self.seen.get("heartbeat", 0) + 1
                continue
            if t == "shutdown" and not h["ok"]:
                raise RunAborted(h["reason"])
            if t == "error":
                self.errors_seen.append(h)
            if t not in want:
                raise ProtocolViolation(f"got {t} ({h}) while waiting for {sorted(want)}")
            return h, frames

    def check(self, frames: list[bytes]) -> dict:
        if len(frames[0]) > 65536:
            raise ProtocolViolation("header above 65,536 bytes")
        h = msgpack.unpackb(frames[0], raw=False)
        if not isinstance(h, dict) or h.get("v") != V or h.get("type") not in S2W:
            raise ProtocolViolation(f"bad header {h!r}")
        fields, nframes = S2W[h["type"]]
        if len(frames) != nframes:
            raise ProtocolViolation(f"{h['type']} with {len(frames)} frames")
        for k, val in h.items():
            if k in ("v", "type"):
                continue
            if k not in fields or not _is(val, fields[k][0]):
                raise ProtocolViolation(f"{h['type']}: unknown or mistyped field {k}={val!r}")
        for k, (_, req) in fields.items():
            if req and k not in h:
                raise ProtocolViolation(f"{h['type']}: missing {k}")
        return h

    def decode_indices(self, h: dict, frame: bytes) -> np.ndarray:
        fmt, count = h.get("index_format", "raw"), h["count"]
        self.seen[f"{h['type']}:{fmt}"] = self.seen.get(f"{h['type']}:{fmt}", 0) + 1
        if h["index_dtype"] not in DTYPES:
            raise ProtocolViolation(f"index_dtype {h['index_dtype']}")
        if fmt == "raw":
            idx = np.frombuffer(frame, DTYPES[h["index_dtype"]]).astype(np.int64)
        elif fmt == "delta":
            idx = np.cumsum(np.array(unleb128(frame), dtype=np.int64))
        elif fmt == "bitmap":
            if len(frame) != (self.numel + 7) // 8:
                raise ProtocolViolation("bitmap length")
            bits = np.unpackbits(np.frombuffer(frame, np.uint8), bitorder="little")
            if bits[self.numel:].any():
                raise ProtocolViolation("bitmap bits beyond numel")
            idx = np.flatnonzero(bits).astype(np.int64)
        elif fmt == "cached":
            known = [s for s in (self.last_sent, self.last_recv)
                     if s is not None and cache_key(s) == frame]
            if len(frame) != 8 or not known:
                raise ProtocolViolation("cached key not held by the receiver")
            idx = known[0]
        else:
            raise ProtocolViolation(f"index_format {fmt}")
        if len(idx) != count:
            raise ProtocolViolation(f"{fmt}: {len(idx)} indices, count {count}")
        if count and (idx[0] < 0 or idx[-1] >= self.numel or np.any(np.diff(idx) <= 0)):
            raise ProtocolViolation("indices not strictly increasing in [0, numel)")
        self.last_recv = idx
        return idx

    def encode_indices(self, idx: np.ndarray, fmt: str, wide: bool) -> tuple[dict, bytes]:
        """(header fields, frame) for ``idx`` in ``fmt`` (falls back to raw where impossible)."""
        dtype = "int64" if wide else "int32"
        if fmt == "cached":
            for s in (self.last_sent, self.last_recv):
                if s is not None and np.array_equal(s, idx):
                    return {"index_dtype": dtype, "index_format": "cached"}, cache_key(idx)
            fmt = "raw"
        if fmt == "delta":
            frame = leb128(idx)
        elif fmt == "bitmap":
            bits = np.zeros(self.numel, np.uint8)
            bits[idx] = 1
            frame = np.packbits(bits, bitorder="little").tobytes()
        else:
            frame = np.asarray(idx, DTYPES[dtype]).tobytes()
        extra = {} if fmt == "raw" else {"index_format": fmt}
        return {"index_dtype": dtype, **extra}, frame

    def send_indexed(self, mtype: str, t: int, idx: np.ndarray, vals: np.ndarray,
                     fmt: str = "raw", wide: bool = False, dense: bool | None = None) -> bool:
        """propose/push in index format ``fmt``; a push goes dense when its sparse form is
        larger ("A sender SHOULD go dense exactly when ...", Budgets) or when ``dense``.
        "index size" there is the run's natural one (int32 up to 2^31-1 entries), not the
        message's ``index_dtype`` (Budgets: the dense switch uses the natural index size): the
        server refuses a dense int64 push that only the wider size would justify."""
        isize = 4 if self.numel <= 2**31 - 1 else 8
        if dense is None:
            dense = mtype == "push" and len(idx) * (isize + 4) > self.numel * 4
        if dense:
            full = np.zeros(self.numel, "<f4")
            full[idx] = vals
            self.send({"type": mtype, "iter": t, "rank": self.rank, "count": self.numel,
                       "index_dtype": "int64" if wide else "int32", "value_dtype": "float32",
                       "dense": True}, b"", full.tobytes())
            return True  # dense messages do not count for key caching
        fields, frame = self.encode_indices(idx, fmt, wide)
        key = f"sent {mtype}:{fields.get('index_format', 'raw')}:{fields['index_dtype']}"
        self.seen[key] = self.seen.get(key, 0) + 1
        self.send({"type": mtype, "iter": t, "rank": self.rank, "count": int(len(idx)),
                   "value_dtype": "float32", **fields},
                  frame, np.asarray(vals, "<f4").tobytes())
        self.last_sent = idx
        return False

    # -- sequences --------------------------------------------------------------------------
    def register(self, proof_override: str | None = None) -> None:
        h = {"type": "register", "rank": self.rank, "world_size": self.world}
        if self.token is not None:
            nonce = secrets.token_hex(16)
            h["nonce"] = nonce
            h["proof"] = proof_override or register_proof(self.token, self.rank, self.world,
                                                          nonce)
        self.send(h)

    def join(self) -> dict:
        # negative: a register whose proof is wrong is refused and changes nothing
        if self.token is not None:
            self.register(proof_override="0" * 64)
            err, _ = self.recv({"error"})
            self.log.append(f"bad proof -> error: {err['message']}")
        self.register()
        ready, _ = self.recv({"ready"})
        run = ready["run"]
        assert ready["world_size"] == self.world
        for f, kind in (("numel", INT), ("iterations", INT), ("two_phase", BOOL),
                        ("steps", LIST), ("config", MAP)):
            assert _is(run[f], kind), (f, run[f])
        assert set(run) == {"numel", "iterations", "two_phase", "steps", "config"}, run.keys()
        self.numel, self.iterations = run["numel"], run["iterations"]
        self.two_phase, self.steps, self.start = run["two_phase"], run["steps"], ready["start"]
        self.heartbeat_s = ready["heartbeat_s"]
        self.hb_thread = threading.Thread(target=self._heartbeats,
                                          args=(ready["token"], ready["heartbeat_s"]),
                                          daemon=True)
        self.hb_thread.start()
        return ready

    def _heartbeats(self, token: str, every: float) -> None:
        s = self._dealer()
        try:
            # negative: a wrong token gets an error on the heartbeat connection
            s.send(pack({"type": "heartbeat", "rank": self.rank, "token": "x" + token}))
            if s.poll(10_000):
                self.hb_errors.append(msgpack.unpackb(s.recv_multipart()[0], raw=False))
            while not self.hb_stop.is_set():
                s.send(pack({"type": "heartbeat", "rank": self.rank, "token": token}))
                while s.poll(0):
                    self.hb_errors.append(msgpack.unpackb(s.recv_multipart()[0], raw=False))
                self.hb_stop.wait(every)
        finally:
            s.close(linger=0)

    def step(self, t: int) -> tuple[int, int, int]:
        """(budget, push_max, propose_max) of the step in force at t."""
        cur = self.steps[0]
        for s in self.steps:
            if s[0] <= t:
                cur = s
        return cur[1], cur[2], cur[3]

    def expect_refusal(self, t: int, mtype: str, idx: np.ndarray, dense=None) -> str:
        self.send_indexed(mtype, t, idx, np.full(len(idx), 1e-6, np.float32), dense=dense)
        err, _ = self.recv({"error"})
        self.last_sent = None  # "MUST forget the set it sent in that message"
        return err["message"]

    def train(self, bad_push_at: int = 7, bad_propose_at: int = 9, stall_at: int = -1) -> None:
        acc = np.zeros(self.numel, np.float32)
        fmts = ["raw", "delta", "bitmap", "cached"]
        for t in range(self.start, self.iterations):
            acc += self.rng.normal(0, 1e-4, self.numel).astype(np.float32)
            _, push_max, propose_max = self.step(t)
            fmt, wide = fmts[t % 4], t % 5 == 0
            if self.two_phase:
                if t == bad_propose_at and propose_max < self.numel:
                    msg = self.expect_refusal(t, "propose", np.arange(propose_max + 1))
                    self.log.append(f"t={t} propose above propose_max -> error: {msg}")
                prop = np.sort(np.argsort(-np.abs(acc), kind="stable")[:propose_max])
                self.send_indexed("propose", t, prop, acc[prop], fmt, wide)
                h, frames = self.recv({"indices"})
                assert h["iter"] == t and h["count"] <= push_max, h
                chosen = self.decode_indices(h, frames[1])
            else:
                if fmt == "cached" and self.last_sent is not None:
                    chosen = self.last_sent  # any valid set: re-push last round's, as a key
                else:
                    chosen = np.sort(np.argsort(-np.abs(acc), kind="stable")[:push_max])
            if t == bad_push_at and push_max < self.numel:
                msg = self.expect_refusal(t, "push", np.arange(push_max + 1))
                self.log.append(f"t={t} push above push_max -> error: {msg}")
            if t == bad_push_at + 1 and push_max * 8 <= self.numel * 4:
                msg = self.expect_refusal(t, "push", np.arange(min(push_max, 3)), dense=True)
                self.log.append(f"t={t} dense push under a sparse budget -> error: {msg}")
            chosen = np.asarray(chosen, np.int64)
            if t == stall_at:  # the server keeps heartbeating while it waits for this push
                hb0 = self.seen.get("heartbeat", 0)
                time.sleep(3 * self.heartbeat_s)
            dense = self.send_indexed("push", t, chosen, acc[chosen], fmt, wide)
            self.seen["push:dense"] = self.seen.get("push:dense", 0) + dense
            self.sent_counts[t] = self.numel if dense else len(chosen)  # dense counts numel
            acc[chosen] = 0.0
            h, frames = self.recv({"aggregate"})
            assert h["iter"] == t and 1 <= h["workers"] <= self.world, h
            vals = np.frombuffer(frames[2], "<f4")
            if h.get("dense"):
                assert frames[1] == b"" and h["count"] == self.numel == len(vals), h
                self.seen["aggregate:dense"] = self.seen.get("aggregate:dense", 0) + 1
            else:
                agg = self.decode_indices(h, frames[1])
                assert len(vals) == h["count"]
                assert np.isin(chosen, agg).all(), "aggregate union lacks my indices"
            assert np.isfinite(vals).all()
            if t == stall_at:
                self.seen["heartbeats during stall"] = self.seen.get("heartbeat", 0) - hb0
            if t == 5 and t < self.iterations - 1:
                # between rounds a worker MAY send metrics for t (not an evaluation: no test_acc)
                self.send({"type": "metrics", "iter": t, "rank": self.rank,
                           "report": {"epoch": 0.0, "train_loss": 1.0}})

    def finish(self) -> dict:
        self.send({"type": "metrics", "iter": self.iterations - 1, "rank": self.rank,
                   "report": {"final": True}})
        h, _ = self.recv({"shutdown"})
        return h

    def close(self) -> None:
        self.hb_stop.set()
        if self.hb_thread is not None:
            self.hb_thread.join(10)
        self.main.close(linger=0)
        self.ctx.term()


# ------------------------------------------------------------------------------------------
# The test: real psparse-server + real psparse-worker + SpecWorker
# ------------------------------------------------------------------------------------------

BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else (shutil.which(name) or name)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


@pytest.mark.parametrize("policy,density,rank", [
    ("topk", 0.05, 1), ("vote", 0.05, 1), ("cltk", 0.05, 1), ("topk", 0.6, 1),
    ("topk", 0.05, 0),  # the spec worker at rank 0: the reference run is rank 1's; no evaluations
])
def test_spec_worker_joins_real_run(tmp_path, policy, density, rank):
    t0 = time.monotonic()
    iterations, token = 30, secrets.token_hex(32)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PSPARSE_TOKEN": token}
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(cmd: list[str], name: str) -> subprocess.Popen:
        path = tmp_path / f"{name}.log"
        logs.append(path)
        with path.open("w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        procs.append(p)
        return p

    worker = None
    try:
        server = start([_tool("psparse-server"), "--workers", "2", "--port", "0", "--out",
                        str(out), "--timeout", "8", "--register-timeout", "60",
                        "--run-token", token], "server")
        deadline = time.monotonic() + 30
        while not (out / "server.port").is_file() or not (out / "server.port").read_text():
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        time.sleep(0.05)
        port = int((out / "server.port").read_text())
        real = start([_tool("psparse-worker"), "--rank", str(1 - rank), "--workers", "2",
                      "--connect", f"127.0.0.1:{port}", "--out", str(out), "--model", "mlp",
                      "--dataset", "digits", "--density", str(density), "--policy", policy,
                      "--iterations", str(iterations), "--eval-every", "10", "--check-every", "5",
                      "--timeout", "8", "--threads", "1"], "real-worker")

        worker = SpecWorker(f"tcp://127.0.0.1:{port}", rank=rank, world=2, token=token)
        ready = worker.join()
        assert ready["run"]["two_phase"] == (policy in ("vote", "cltk"))
        assert ready["run"]["iterations"] == iterations and ready["start"] == 0
        worker.train(stall_at=12 if (policy, density, rank) == ("topk", 0.05, 1) else -1)
        bye = worker.finish()
        assert bye["ok"] is True, bye
        worker.close()
        sent, hb_errors, log, seen = (worker.sent_counts, worker.hb_errors, worker.log,
                                      worker.seen)
        worker = None

        assert server.wait(30) == 0
        assert real.wait(30) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "ok", summary
        assert summary["world_size"] == 2 and summary["iterations"] == iterations
        # bad proof, bad heartbeat token, push above cap, dense push under a sparse budget
        # (sparse runs), proposal above cap (two-phase runs)
        expect_rejected = 3 + (policy != "topk") - (density > 0.5)
        assert summary["rejected_messages"] >= expect_rejected, summary
        if "heartbeats during stall" in seen:
            assert seen["heartbeats during stall"] >= 2, seen
        if density > 0.5:
            assert seen.get("push:dense") and seen.get("aggregate:dense"), seen
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["iter"] for m in metrics] == list(range(iterations))
        for m in metrics:
            assert m["workers"] == 2 and m["k"][rank] == sent[m["iter"]], m
        assert hb_errors and hb_errors[0]["type"] == "error", hb_errors
        evals = out / "eval.jsonl"
        evals = [json.loads(x) for x in evals.read_text().splitlines()] if evals.exists() else []
        if rank == 1:  # the real worker is the evaluator
            assert evals and summary["test_acc"] is not None, summary
        else:  # the spec worker's between-round metrics carry a train_loss and no test_acc:
            # evaluations without an accuracy (docs/protocol.md, metrics)
            assert evals and all(e["train_loss"] == 1.0 and "test_acc" not in e
                                 for e in evals), evals
            assert summary["test_acc"] is None, summary
        print(f"{policy}/{density}: ok in {time.monotonic() - t0:.1f}s", seen, *log, summary,
              sep="\n")
    except BaseException:
        for path in logs:
            if path.exists():
                print(f"---- {path.name}\n{path.read_text()[-4000:]}")
        raise
    finally:
        if worker is not None:
            worker.close()
        for p in procs:
            _kill(p)
