"""Push/aggregate round trips through our protocol vs a raw ZeroMQ multipart echo.

A peer process echoes what it receives. Raw: the client sends the index and value bytes as two
frames and the peer sends them straight back (the received frames themselves). Raw re-sent:
the same, but the peer sends numpy views of what it received, as new zero-copy messages, as a
server sending arrays it computed must (pyzmq releases each through its garbage-collector
thread): the gap between raw and raw re-sent is ZeroMQ's, not the protocol's. Ours: the client
encodes a push (msgpack header + index and value frames), the peer decodes and validates it
(version, fields, sizes, sorted in-range indices, finite values), re-encodes it as an aggregate
and sends it back, and the client decodes and validates that. Same entries, same sockets
(DEALER -> ROUTER over loopback TCP).

Rows: 1 MB and 100 MB of raw int32 indices (random over 2^31 entries: no compact form is
allowed), and 1 MB of entries at density 1% of a 12.5M-entry model, where the index frames go
delta-coded (as a real run's pushes and aggregates do at that density) while the raw echoes
still move the uncoded bytes.

Read once: raw re-sent, with each end reading every received byte once (a max over the
indices, a dot product of the values) and checking nothing: the floor for any protocol that
validates every entry (the received frames were written by ZeroMQ's I/O thread, on another
core). For the delta-coded row also the codec floor: read once plus the thread CPU of the
round trip's two delta encodes and two decodes alone (in this process, same run): what ours
would cost if the LEB128 codec were its only work beyond reading.

Two measures, the four kinds alternating in blocks so drift in machine load hits all: wall
time (median round trip), and CPU time per round trip, client and peer processes together
(ZeroMQ's I/O threads included), the median over blocks; also the CPU of the two main threads
alone, whose difference between ours and raw re-sent is the protocol's own work (encoding,
decoding, validation). On a shared or CPU-capped machine the wall time counts waits for the
CPU; the CPU ratio does not.
Target: our throughput at least 80% of raw at 1 MB and 100 MB payloads.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import record, table  # noqa: E402

from psparse.ops.codec import codec  # noqa: E402
from psparse.wire import protocol  # noqa: E402
from psparse.wire.transport import Channel  # noqa: E402

NUMEL = 2**31 - 1
# (label, payload MB, model size the indices come from, compact index forms allowed, blocks,
# round trips per block, bench.json key, target: ours/raw CPU)
ROWS = [("1 MB", 1, NUMEL, False, 24, 20, "protocol_1mb_vs_raw_cpu", 0.8),
        ("1 MB, delta", 1, 12_500_000, True, 24, 20, "protocol_delta_1mb_vs_raw_cpu", 0.5),
        ("100 MB", 100, NUMEL, False, 3, 2, "protocol_100mb_vs_raw_cpu", 0.9)]


def read_once(idx: np.ndarray, val: np.ndarray) -> None:
    """Every received byte read once, nothing checked: the least any validation of each entry
    costs."""
    idx.max()
    np.dot(val, val)


def peer(port_queue) -> None:
    ch = Channel.server("127.0.0.1", 0)
    port_queue.put(ch.port)
    numel, size = NUMEL, None
    main_cpu = 0.0  # this thread's CPU in handling messages (ZeroMQ's I/O thread excluded)
    while True:
        peer_id, frames, _ = ch.recv(120)
        t = time.thread_time()
        if len(frames) == 1:  # control: stop, the model size of the next row, or CPU so far
            text = frames[0].bytes.decode()
            if text == "stop":
                break
            if text.startswith("numel="):
                count, _, coded = text[6:].partition(" ")
                numel = int(count)
                size = numel if coded else None
            ch.send([f"{time.process_time()} {main_cpu}".encode()], peer_id)
            continue
        if len(frames) == 2:  # raw echo
            ch.send(frames, peer_id)
        elif frames[0].bytes in (b"resend", b"read"):  # raw, re-sent as new messages
            idx = np.frombuffer(frames[1].buffer, np.int32)
            val = np.frombuffer(frames[2].buffer, np.float32)
            if frames[0].bytes == b"read":
                read_once(idx, val)
            ch.send([idx, val], peer_id)
        else:
            msg = protocol.decode(frames, numel=numel)
            ch.send(protocol.encode("aggregate", msg.indices, msg.values, iter=msg["iter"],
                                    workers=1, model_size=size), peer_id)
        main_cpu += time.thread_time() - t
    ch.close()


def main() -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=peer, args=(q,), daemon=True)
    proc.start()
    ch = Channel.client("127.0.0.1", q.get(timeout=60))

    def peer_cpu(command: str = "cpu") -> tuple[float, float]:
        """The peer's CPU so far: (process, main thread handling messages)."""
        ch.send([command.encode()])
        process, main = ch.recv(60)[1][0].bytes.split()
        return float(process), float(main)

    rows, results = [], {}
    try:
        for label, mb, numel, coded, blocks, reps, key, target in ROWS:
            k = mb * 1_000_000 // 8  # int32 index + float32 value per entry
            rng = np.random.default_rng(mb)
            idx = np.sort(rng.choice(numel if mb < 50 else 4 * k, k, replace=False)) \
                .astype(np.int32)
            val = rng.standard_normal(k).astype(np.float32)
            size = numel if coded else None  # model_size: the encoder may pick a compact form
            peer_cpu(f"numel={numel}" + (" coded" if coded else ""))

            def raw():
                ch.send([idx, val])
                ch.recv(120)

            def resent():
                ch.send([b"resend", idx, val])
                ch.recv(120)

            def read():
                ch.send([b"read", idx, val])
                _, frames, _ = ch.recv(120)
                read_once(np.frombuffer(frames[0].buffer, np.int32),
                          np.frombuffer(frames[1].buffer, np.float32))

            def ours():
                ch.send(protocol.encode("push", idx, val, iter=0, rank=0, model_size=size))
                _, frames, _ = ch.recv(120)
                msg = protocol.decode(frames, numel=numel)
                assert msg.indices.size == k

            fmt = codec.choose(idx, numel)[0] if coded else "raw"  # both directions' form
            wall = {raw: [], resent: [], read: [], ours: []}
            cpu = {raw: [], resent: [], read: [], ours: []}
            main_cpu = {raw: [], resent: [], read: [], ours: []}  # the processes' main threads
            for fn in wall:
                fn()  # warm-up
            for _ in range(blocks):
                for fn in wall:
                    (p0, pm0), c0, cm0 = peer_cpu(), time.process_time(), time.thread_time()
                    for _ in range(reps):
                        t = time.perf_counter()
                        fn()
                        wall[fn].append(time.perf_counter() - t)
                    c1, cm1, (p1, pm1) = time.process_time(), time.thread_time(), peer_cpu()
                    cpu[fn].append((c1 - c0 + p1 - p0) / reps)
                    main_cpu[fn].append((cm1 - cm0 + pm1 - pm0) / reps)
            t_raw, t_ours = statistics.median(wall[raw]), statistics.median(wall[ours])
            c_raw, c_resent, c_read, c_ours = (statistics.median(cpu[f])
                                               for f in (raw, resent, read, ours))
            m_resent, m_ours = (statistics.median(main_cpu[f]) for f in (resent, ours))
            codec_s = codec_seconds(idx) if fmt == "delta" else None
            rows.append([label, f"{k:,}", fmt, f"{t_raw * 1e3:.2f}", f"{t_ours * 1e3:.2f}",
                         f"{t_raw / t_ours:.0%}", f"{c_raw * 1e3:.2f}", f"{c_resent * 1e3:.2f}",
                         f"{c_ours * 1e3:.2f}", f"{c_raw / c_ours:.0%}",
                         f"{c_resent / c_ours:.0%}", f"{c_raw / c_read:.0%}",
                         f"{m_resent * 1e3:.2f}",
                         f"{m_ours * 1e3:.2f}"])
            results[key] = {
                "payload": label, "entries": k, "index_frame": fmt, "ratio": round(c_raw / c_ours, 4),
                "target": target, "met": c_raw / c_ours >= target,
                "read_once_ratio": round(c_raw / c_read, 4),
                "resent_ratio": round(c_raw / c_resent, 4),
                "wall_ratio": round(t_raw / t_ours, 4),
                "cpu_ms": {"raw": round(c_raw * 1e3, 4), "resent": round(c_resent * 1e3, 4),
                           "read_once": round(c_read * 1e3, 4), "ours": round(c_ours * 1e3, 4)},
                "protocol_own_cpu_ms": round((m_ours - m_resent) * 1e3, 4),
                **({} if codec_s is None else {
                    "codec_ms": round(codec_s * 1e3, 4),
                    "codec_floor_ratio": round(c_raw / (c_read + codec_s), 4)}),
                "baseline": "raw ZeroMQ echo of the same index and value bytes, CPU time of "
                            "client and peer (all threads) per round trip"}
    finally:
        ch.send([b"stop"])
        ch.close()
        proc.join(10)
    print("Round trip of one payload each way (ratios measured in this run)")
    print(table(rows, ["payload", "entries", "index frame", "raw ms", "ours ms", "ours/raw",
                       "raw CPU ms", "re-sent CPU ms", "ours CPU ms", "ours/raw CPU",
                       "ours/re-sent CPU", "read-once/raw CPU", "re-sent main ms",
                       "ours main ms"]))
    print("ms: medians per round trip (wall), and per round trip over blocks (CPU: client and "
          "peer processes, all threads; main: their main threads only, i.e. without ZeroMQ's "
          "I/O threads: the protocol's own work is ours main - re-sent main); a/b: b's time "
          "over a's, i.e. a's throughput as a fraction of b's; read-once: re-sent, each end "
          "reading every received byte once (the least that checking every entry costs)")
    for row in results.values():
        if "codec_floor_ratio" in row:
            print(f"{row['payload']}: the codec alone (two delta encodes and two decodes of the "
                  f"{row['entries']:,} indices, in process) takes {row['codec_ms']:.2f} ms a round "
                  f"trip; read once plus that would be {row['codec_floor_ratio']:.0%} of raw "
                  f"(ours {row['ratio']:.0%}, target {row['target']:.0%})")
    record(results)
    return 0


def codec_seconds(idx: np.ndarray, reps: int = 200) -> float:
    """Thread CPU of what a delta-coded round trip's index frames need at least: two encodes
    and two decodes (push and aggregate), the compiled kernels with the decoder's checks,
    nothing else (the median over ``reps``)."""
    frame = np.frombuffer(codec.encode_delta(idx).tobytes(), np.uint8)  # read-only, as received
    times = []
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(2):
            codec.encode_delta(idx)
            codec.decode_delta(frame, idx.size, idx.dtype)
        times.append(time.thread_time() - t)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
