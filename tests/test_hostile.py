"""A rogue client floods a live server with malformed messages while real workers train.

The server must survive, answer every message with an error, and the workers' metrics and final
weights must be identical to the same run without the rogue.
"""

from __future__ import annotations

import json
import math
import threading
import time

import msgpack
import numpy as np
import zmq
from conftest import read_jsonl, start_launch

from psparse.wire import protocol

MESSAGES = 10_000
RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "700",
       "--eval-every", "100", "--check-every", "1", "--seed", "11", "--max-message-mb", "1",
       "--quiet"]


def malformed(rng: np.random.Generator, i: int) -> list[bytes]:
    """The i-th hostile message: one of many kinds of bad input."""
    idx = np.sort(rng.choice(2410, 5, replace=False)).astype(np.int32)
    val = rng.standard_normal(5).astype(np.float32)
    good = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
            for f in protocol.encode("push", idx, val, iter=0, rank=0)]
    head = msgpack.unpackb(good[0])
    kind = i % 20

    def with_header(**changes):
        return [msgpack.packb({**head, **changes}), *good[1:]]

    if kind == 0:
        return [rng.bytes(int(rng.integers(0, 200)))]
    if kind == 1:
        return [rng.bytes(int(rng.integers(1, 50))) for _ in range(int(rng.integers(2, 6)))]
    if kind == 2:
        return [good[0], good[1], good[2][:-3]]  # truncated values
    if kind == 3:
        return with_header(count=7)
    if kind == 4:
        bad = idx.copy()
        bad[-1] = 10**6
        return [good[0], bad.tobytes(), good[2]]  # index out of range
    if kind == 5:
        bad = idx.copy()
        bad[0] = -4
        return [good[0], bad.tobytes(), good[2]]
    if kind == 6:
        return [good[0], good[1], np.array([1, 2, math.nan, 4, 5], np.float32).tobytes()]
    if kind == 7:
        return [good[0], good[1], np.array([1, 2, 3, 4, math.inf], np.float32).tobytes()]
    if kind == 8:
        return with_header(v=protocol.PROTOCOL_VERSION + 1)
    if kind == 9:
        return with_header(type="gradient")
    if kind == 10:
        return with_header(rank=int(rng.integers(0, 3)), iter=int(rng.integers(0, 700)))
    if kind == 11:
        return good  # a replay of an iteration-0 push, from a stranger
    if kind == 12:
        return [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "register", "rank": 1,
                               "world_size": 3, "checksum": "x", "run": {
                                   "numel": 2410, "iterations": 700, "two_phase": False,
                                   "steps": [[0, 24, 24, 0]], "config": {}}})]
    int8 = dict(value_dtype="int8", value_block=4)  # 5 values: 2 scales, then 5 codes
    codes = np.array([1, -2, 3, 4, 5], np.int8).tobytes()
    if kind == 13:  # one scale where two are due
        return [with_header(**int8)[0], good[1], np.float32([0.5]).tobytes() + codes]
    if kind == 14:  # a NaN scale
        return [with_header(**int8)[0], good[1], np.float32([0.5, math.nan]).tobytes() + codes]
    if kind == 15:  # an over-long value frame
        return [with_header(**int8)[0], good[1], np.float32([0.5, 1]).tobytes() + codes + b"x"]
    if kind == 16:  # int8 values without their block size
        return [with_header(value_dtype="int8")[0], good[1],
                np.float32([0.5, 1]).tobytes() + codes]
    if kind in (17, 18):  # a block size that would have the decoder allocate TiBs
        return [with_header(value_dtype="int8", value_block=2 ** 40 if kind == 17 else 2 ** 63)[0],
                good[1], np.float32([0.5]).tobytes() + codes]
    return [good[0], good[1]]  # missing frame


class Rogue(threading.Thread):
    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.sent, self.errors, self.oversize = port, 0, 0, 0
        self.exc: BaseException | None = None

    def run(self):
        try:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            rng = np.random.default_rng(5)
            for i in range(MESSAGES):
                sock.send_multipart(malformed(rng, i))
                self.sent += 1
                self._drain(sock, 0)
            deadline = time.monotonic() + 60
            while self.errors < self.sent and time.monotonic() < deadline:
                self._drain(sock, 100)
            # last, frames over --max-message-mb: ZeroMQ drops such a connection unread
            for _ in range(3):
                sock.send_multipart([b"\x00" * 1_500_000])
                self.oversize += 1
            time.sleep(0.5)
            sock.close()
            ctx.term()
        except BaseException as exc:  # reported by the test
            self.exc = exc

    def _drain(self, sock, timeout_ms):
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            assert msgpack.unpackb(frames[0])["type"] == "error"
            self.errors += 1
            timeout_ms = 0


def launch(out):
    return start_launch("--out", str(out), *RUN)


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


def test_fuzzing_a_live_server_changes_nothing_for_real_workers(tmp_path):
    ref = launch(tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.communicate()[0]

    attacked = launch(tmp_path / "att")
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "att" / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 5):
            assert attacked.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rogue = Rogue(int((tmp_path / "att" / "server.port").read_text()))
        rogue.start()
        code = attacked.wait(timeout=300)
        rogue.join(timeout=60)
    finally:
        if attacked.poll() is None:
            attacked.kill()
    assert rogue.exc is None, rogue.exc
    assert code == 0, attacked.communicate()[0]
    print(f"fuzz: {rogue.sent} malformed messages sent, {rogue.errors} error replies, "
          f"{rogue.oversize} oversize frames dropped; server crashes: 0")
    assert rogue.sent == MESSAGES and rogue.errors == MESSAGES  # every message answered
    summary = json.loads((tmp_path / "att" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["rejected_messages"] == MESSAGES
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(tmp_path / "att" / name)) == \
            without_timing(read_jsonl(tmp_path / "ref" / name)), name
    for r in range(3):
        a = json.loads((tmp_path / "att" / f"rank-{r}.json").read_text())
        b = json.loads((tmp_path / "ref" / f"rank-{r}.json").read_text())
        assert a["checksum"] == b["checksum"]  # identical final weights
