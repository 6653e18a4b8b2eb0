"""Push/aggregate round trips through our protocol vs a raw ZeroMQ multipart echo.

A peer process echoes what it receives. Raw: the client sends the index and value bytes as two
frames and the peer sends them straight back. Ours: the client encodes a push (msgpack header +
raw frames), the peer decodes and validates it (version, fields, sizes, sorted in-range indices,
finite values), re-encodes it as an aggregate and sends it back, and the client decodes and
validates that. Same payload, same sockets (DEALER -> ROUTER over loopback TCP).
Target: our throughput at least 80% of raw at 1 MB and 100 MB payloads.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import interleaved_medians, table  # noqa: E402

from psparse import protocol  # noqa: E402
from psparse.transport import Channel  # noqa: E402

PAYLOADS_MB = [1, 100]
NUMEL = 2**31 - 1


def peer(port_queue) -> None:
    ch = Channel.server("127.0.0.1", 0)
    port_queue.put(ch.port)
    while True:
        peer_id, frames, _ = ch.recv(60)
        if len(frames) == 1 and frames[0].bytes == b"stop":
            break
        if len(frames) == 2:  # raw echo
            ch.send(frames, peer_id)
            continue
        msg = protocol.decode(frames, numel=NUMEL)
        ch.send(protocol.encode("aggregate", msg.indices, msg.values, iter=msg["iter"],
                                workers=1), peer_id)
    ch.close()


def main() -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=peer, args=(q,), daemon=True)
    proc.start()
    ch = Channel.client("127.0.0.1", q.get(timeout=60))
    rows = []
    try:
        for mb in PAYLOADS_MB:
            k = mb * 1_000_000 // 8  # int32 index + float32 value per entry
            rng = np.random.default_rng(mb)
            idx = np.sort(rng.choice(NUMEL if mb < 50 else 4 * k, k, replace=False)) \
                .astype(np.int32)
            val = rng.standard_normal(k).astype(np.float32)

            def raw():
                ch.send([idx, val])
                ch.recv(60)

            def ours():
                ch.send(protocol.encode("push", idx, val, iter=0, rank=0))
                _, frames, _ = ch.recv(60)
                msg = protocol.decode(frames, numel=NUMEL)
                assert msg.indices.size == k

            reps = 401 if mb < 10 else 9
            t_raw, t_ours = interleaved_medians(raw, ours, reps)
            gbps = lambda t: 2 * mb / 1000 / t  # noqa: E731 - both directions
            rows.append([f"{mb} MB", f"{k:,}", f"{t_raw * 1e3:.2f}", f"{t_ours * 1e3:.2f}",
                         f"{gbps(t_raw):.2f}", f"{gbps(t_ours):.2f}", f"{t_raw / t_ours:.0%}"])
    finally:
        ch.send([b"stop"])
        ch.close()
        proc.join(10)
    print("Round trip of one payload each way (median; ratio measured in this run)")
    print(table(rows, ["payload", "entries", "raw ms", "ours ms", "raw GB/s", "ours GB/s",
                       "ours/raw throughput"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
