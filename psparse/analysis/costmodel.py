"""psparse-model: predicted time per iteration of centralized and decentralized exchanges.

For N workers, a model of n float32 entries, k entries per push and a server broadcast of U
entries (the union), on links of bandwidth B (bytes/s) and one-way latency L, with compute time
C per iteration (forward, backward, selection; no overlap with communication, as in synchronous
SGD), each (index, value) pair taking e = index size + 4 bytes plus a header h per message:

  sparse PS           C + [N (k e + h) + N (U e + h)] / B + 2 L
                      (the server's link carries every push in and every broadcast out)
  sparse allgather    C + (N - 1)(k e + h) / B + (N - 1) L
                      (ring allgather: each worker receives every other worker's k pairs)
  dense PS            C + 2 N (4 n + h) / B + 2 L
  dense ring allreduce C + 2 (N - 1)/N (4 n) / B + 2 (N - 1) L
  PowerSGD (rank r)   C + 2 (N - 1)/N 4 (u + p + q) / B + 3 . 2 (N - 1) L
                      (DDP's comm hook: u uncompressed entries (1-D tensors and matrices too
                      small to gain 2x) allreduced with the P factors (p = sum of rows x r),
                      then the Q factors (q = sum of columns x r): powersgd_sizes)

Past one server (issue 54; ``ps_link_bytes``): with S shards on hosts of their own the busiest
shard's link carries N (k e / S + h) in and N (U e / S + h) out (times the shard imbalance, the
busiest shard's bytes over the mean's); with a shard beside every worker (``--colocated``, S = N)
every host's link carries (N - 1)/N (k + U) e + 2 (N - 1) h each way, about (k + U) e whatever N is
(the busiest host's shard, f times the mean: k e (1 - f/N) + f (N - 1)/N U e out, the mirror image
in). e counts the value format's bytes (``--values``: int4 is half a byte plus a float32 scale per
block). On a full-duplex link (``--full-duplex``) the larger direction is the link's time, not the
sum of both.

CPU of the exchange (issue 15): on hosts that get a share s of a core (the emulated cluster's
CFS quota; a small node), the exchange's own CPU work W takes W / s of wall time, and the
formulas above, which count the link only, miss by 27-51% there. With cpu_share, server_cpu_s
(the PS server's CPU per round: decoding N pushes, aggregating, encoding and sending N
aggregates), worker_comm_cpu_s (a worker's CPU per iteration in a collective) and
worker_ps_cpu_s (a worker's CPU per iteration in a PS round: S pushes encoded, S aggregates
decoded and merged):

  sparse / dense PS   the link term X becomes max(X, S) + min(X, S) / 2N, S = server_cpu / s
                      (the server's CPU and its link overlap message by message, 2N messages);
                      with a shard beside every worker S = server_cpu / N + worker_ps_cpu / s:
                      the shard and the worker share the host's CPU. A worker on a host of its
                      own does its part while it waits for the server's link (not counted).
                      Checked on the emulated cluster (issue 54, LeNet-5 at 25 Mbit/s, 1/6-core
                      hosts, N = 4 and 8, S = 1, 2 and N): every point within 15%
  collectives         + worker_comm_cpu / s: every step's send waits for the previous step's
                      receive and reduction, so a worker's exchange CPU is in series with the
                      link (allgather, ring; PowerSGD, whose CPU includes the hook's products)
  L stays the latency per dependent step; on the emulated hosts a tiny allreduce measures it
  (experiments/cluster.py --probe-steps: 0.19 ms per ring step on idle 2/9-core hosts).

Without them (the defaults) the formulas are the link-only ones.

Bytes on a real link are more than the payload: every TCP segment of at most 1448 payload
bytes (MSS at MTU 1500 with timestamps) carries 66 bytes of TCP/IP/Ethernet headers, which a
shaper such as tc tbf counts (WIRE_OVERHEAD; 1.0 for pacing by sleep, which counts payload).

The thesis compares the first two (centralized vs decentralized models of equal cost when the
union is k). Given a run directory, U, k, n, N and the measured bytes per iteration are read
from it, and C is the run's measured time per iteration minus its own modelled communication
(for a run under --bandwidth) -- so one run predicts any other bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ops.values.formats import ValueFormat
from ..rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, read_json, read_jsonl
from ..wire.transport import parse_rate

HEADER_BYTES = 110  # a push/aggregate header with its ZMTP framing, measured
WIRE_OVERHEAD = 1514 / 1448  # Ethernet+IPv4+TCP (timestamps) headers per full segment


@dataclass
class Setting:
    numel: int
    k: float
    workers: int
    union: float
    compute_s: float
    index_bytes: int = 4
    up_bytes: float | None = None  # measured bytes per iteration, all workers' pushes
    down_bytes: float | None = None  # measured bytes per iteration, all broadcasts
    powersgd_entries: int | None = None  # u + p + q of powersgd_sizes, when known
    ring_value_bytes: int = 4  # a dense ring's bytes per value: 2 with DDP's fp16/bf16 hooks
    # CPU of the exchange itself, in CPU seconds per iteration at full speed (0: not counted),
    # and the fraction of a core each host gets (None: a whole core). On a host limited to a
    # share s, W CPU seconds take W / s of wall time (CFS quota: s of every period).
    cpu_share: float | None = None
    server_cpu_s: float = 0.0  # the PS server's decode, aggregation, encode, sends per round
    worker_comm_cpu_s: float = 0.0  # a worker's part of a collective (reductions, copies)
    # a worker's part of a PS round: splitting its push by shard, encoding S pushes, decoding
    # and merging S aggregates (it grows with S); counted where it shares a host with a shard
    worker_ps_cpu_s: float = 0.0
    # Past one server (issue 54): S shards, each a 1/S of the keys; on hosts of their own, or
    # ``colocated``, one beside each worker (S = N), as BytePS places them. ``shard_imbalance``:
    # the busiest shard's bytes over the mean shard's (1: balanced; LeNet-5's equal key ranges
    # at S = 4 measured 1.4). ``value_bytes``: a value's bytes on the wire (fp32 4, bf16 and
    # fp16 2, int8 1 and int4 0.5, plus a float32 scale per block: value_bytes_of).
    # ``full_duplex``: a link sends and receives at once, so its time is the larger direction's
    # (False: in and out add, the formulas' first form).
    servers: int = 1
    colocated: bool = False
    shard_imbalance: float = 1.0
    value_bytes: float = 4.0
    full_duplex: bool = False


def value_bytes_of(values: str, block: int = 128) -> float:
    """Bytes per value on the wire of a ``--values`` format (int8/int4: the block's float32
    scale shared by its ``block`` values)."""
    return ValueFormat.named(values, block).bytes_per_value


def ps_link_bytes(s: Setting) -> tuple[float, float]:
    """(in, out) bytes per iteration on the busiest link of a sparse parameter-server round.

    One server or S shards on hosts of their own: a shard's link takes every worker's push
    share (k e / S, and a header per message) in and sends every worker its share of the
    broadcast (U e / S) out, times the imbalance; a worker's link carries k e + S h out and
    U e + S h in, the busier of the two kinds of link counts. Shards beside the workers (S =
    N): each host's link carries its worker's pushes to the N - 1 other shards and its shard's
    broadcast to the N - 1 other workers out, and the mirror image in: about (k + U) e each
    way whatever N is, plus 2 (N - 1) headers."""
    e, h, N, S = s.index_bytes + s.value_bytes, HEADER_BYTES, s.workers, s.servers
    if S == 1 and not s.colocated and s.up_bytes is not None and s.down_bytes is not None:
        return s.up_bytes, s.down_bytes  # a run's measured bytes, as they were
    k_bytes = s.up_bytes / N - h if s.up_bytes is not None else s.k * e
    u_bytes = s.down_bytes / N - h if s.down_bytes is not None else s.union * e
    if s.colocated:
        # the host whose shard carries f times the mean: its worker's pushes to the other
        # shards and its shard's broadcast to the other workers out, the mirror image in
        f = s.shard_imbalance
        out = k_bytes * (1 - f / N) + f * (N - 1) / N * u_bytes + 2 * (N - 1) * h
        into = f * (N - 1) / N * k_bytes + u_bytes * (1 - f / N) + 2 * (N - 1) * h
        return into, out
    shard_in = N * (k_bytes / S * s.shard_imbalance + h)
    shard_out = N * (u_bytes / S * s.shard_imbalance + h)
    worker_in, worker_out = u_bytes + S * h, k_bytes + S * h
    if (max(worker_in, worker_out) if s.full_duplex else worker_in + worker_out) > \
            (max(shard_in, shard_out) if s.full_duplex else shard_in + shard_out):
        return worker_in, worker_out
    return shard_in, shard_out


def predict(s: Setting, bandwidth_bps: float, latency_s: float = 0.0,
            wire_overhead: float = 1.0) -> dict[str, float]:
    """Seconds per iteration for each scheme. ``wire_overhead``: link bytes per payload byte
    (WIRE_OVERHEAD on a real link; 1.0 for --bandwidth pacing, which counts payload)."""
    B = bandwidth_bps / 8.0 / wire_overhead
    e, h, N = s.index_bytes + s.value_bytes, HEADER_BYTES, s.workers
    link_in, link_out = ps_link_bytes(s)
    ps_link = (max(link_in, link_out) if s.full_duplex else link_in + link_out) / B
    share = s.cpu_share or 1.0
    server_cpu, worker_cpu = s.server_cpu_s / share, s.worker_comm_cpu_s / share
    # beside the workers a host's CPU serves its shard and its worker's round alike
    shard_cpu = server_cpu / s.servers + (s.worker_ps_cpu_s / share if s.colocated else 0.0)

    def overlap(link: float, cpu: float, messages: int) -> float:
        # the PS server's messages are independent: its CPU and its link work message by
        # message, overlapped: the longer of the two plus the shorter one's part of a message
        return max(link, cpu) + min(link, cpu) / messages

    # collectives: each step's send waits for the previous step's receive and reduction, so
    # a worker's exchange CPU is in series with its link time
    ring = 2 * (N - 1)  # dependent steps of a ring allreduce
    extra = {}
    if s.powersgd_entries is not None:
        extra["PowerSGD"] = s.compute_s + 2 * (N - 1) / N * 4 * s.powersgd_entries / B \
            + worker_cpu + 3 * ring * latency_s
    return {
        # (S shards share the server's CPU; beside the workers it is on their hosts)
        "sparse PS": s.compute_s + overlap(ps_link, shard_cpu, 2 * N) + 2 * latency_s,
        "sparse allgather": s.compute_s + (N - 1) * (s.k * e + h) / B + worker_cpu
        + (N - 1) * latency_s,
        "dense PS": s.compute_s + overlap(2 * N * (4 * s.numel + h) / B, server_cpu, 2 * N)
        + 2 * latency_s,
        "dense ring allreduce": s.compute_s
        + 2 * (N - 1) / N * s.ring_value_bytes * s.numel / B + worker_cpu
        + ring * latency_s,
        **extra,
    }


def setting_from_run(run_dir: Path) -> tuple[Setting, dict]:
    """Figures of a finished run; compute time net of its own (paced) communication."""
    summary, config = read_json(run_dir, SUMMARY_FILE), read_json(run_dir, CONFIG_FILE)
    metrics = read_jsonl(run_dir / METRICS_FILE)
    if not metrics:
        raise ValueError(f"{run_dir}: no iterations recorded")
    iters = len(metrics)
    # round_s runs from the first message of a round to the aggregate's send: the time between
    # rounds is the workers' compute (and any evaluation, left out via the median)
    times = np.diff([m["time_s"] for m in metrics])
    measured = float(np.median(times)) if times.size else summary["wall_s"] / iters
    s = Setting(numel=summary["numel"], k=float(np.mean([m["budget"] for m in metrics])),
                workers=summary["world_size"],
                union=float(np.mean([m["broadcast_entries"] for m in metrics])),
                compute_s=0.0, index_bytes=4 if summary["numel"] < 2**31 else 8,
                up_bytes=float(np.mean([m["upload_bytes"] for m in metrics])),
                down_bytes=float(np.mean([m["broadcast_bytes"] for m in metrics])))
    paced = config.get("bandwidth")
    comm = predict(s, parse_rate(paced))["sparse PS"] if paced else 0.0
    s.compute_s = max(0.0, measured - comm)
    return s, {"measured_s": measured, "bandwidth": paced, "iterations": iters}


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Trainable parameter shapes of a built-in model (torch is imported only here)."""
    from ..data import IN_SHAPES
    from ..training.models import build_model

    dataset = {"lenet": "mnist", "lenet-cifar": "cifar10", "resnet20": "cifar10",
               "mlp": "digits"}.get(name)
    if dataset is None:
        raise ValueError(f"--model {name!r}: choose lenet, lenet-cifar, resnet20 or mlp")
    net = build_model(name.split("-")[0], IN_SHAPES[dataset], 10)
    return [tuple(q.shape) for q in net.parameters() if q.requires_grad]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psparse-model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=None,
                   help="take n, k, N, union, bytes and compute time from this run directory")
    p.add_argument("--numel", type=int, help="model entries n")
    p.add_argument("--k", type=float, help="entries per push")
    p.add_argument("--workers", type=int, help="workers N")
    p.add_argument("--union", type=float, help="entries per broadcast (default: k)")
    p.add_argument("--compute", type=float, help="compute seconds per iteration")
    p.add_argument("--bandwidth", action="append", default=None,
                   help="link rate, e.g. 100Mbit, 1Gbit (repeatable; default 1Gbit, 10Gbit)")
    p.add_argument("--latency", type=float, default=0.0,
                   help="one-way latency per dependent step in ms (default 0)")
    p.add_argument("--wire-overhead", action="store_true",
                   help=f"count TCP/IP/Ethernet headers ({WIRE_OVERHEAD:.4f} link bytes per "
                        "payload byte), as a real or tc-shaped link does (default: payload "
                        "only, as --bandwidth pacing counts)")
    p.add_argument("--cpu-share", type=float, default=None,
                   help="fraction of a core each host gets (e.g. 0.1667 on the emulated "
                        "cluster's 1/6-core hosts); the CPU terms below take W / share")
    p.add_argument("--server-cpu", type=float, default=0.0,
                   help="the PS server's CPU ms per round at full speed (decode N pushes, "
                        "aggregate, encode and send N aggregates); overlaps its link")
    p.add_argument("--worker-comm-cpu", type=float, default=0.0,
                   help="a worker's CPU ms per iteration inside a collective (gloo's copies "
                        "and reductions; PowerSGD's products); in series with the link")
    p.add_argument("--worker-ps-cpu", type=float, default=0.0,
                   help="a worker's CPU ms per iteration in a PS round at full speed (its "
                        "pushes encoded, the aggregates decoded and merged: S of each with "
                        "--servers S); with --colocated it shares the host's CPU with the "
                        "shard's (elsewhere it overlaps the wait for the server)")
    p.add_argument("--powersgd-rank", type=int, default=None,
                   help="add a PowerSGD column at this rank (needs --model for the layer shapes)")
    p.add_argument("--model", default=None,
                   help="built-in model whose layer shapes size PowerSGD's factors: lenet "
                        "(MNIST), lenet-cifar, resnet20 or mlp")
    p.add_argument("--servers", type=int, default=1,
                   help="server shards S, each a 1/S of the keys (default 1)")
    p.add_argument("--colocated", action="store_true",
                   help="one shard beside each worker, on its host and link (needs --servers "
                        "equal to --workers)")
    p.add_argument("--shard-imbalance", type=float, default=1.0,
                   help="the busiest shard's bytes over the mean shard's (default 1: balanced)")
    p.add_argument("--values", default="fp32",
                   help="the values' wire format: fp32, bf16, fp16, int8 or int4 (default fp32)")
    p.add_argument("--value-block", type=int, default=128,
                   help="with int8/int4: values per float32 scale (default 128)")
    p.add_argument("--full-duplex", action="store_true",
                   help="links send and receive at once: a link's time is its larger "
                        "direction's (default: in and out add)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.run:
            s, info = setting_from_run(args.run)
        else:
            missing = [f for f in ("numel", "k", "workers", "compute") if getattr(args, f) is None]
            if missing:
                p.error("without --run, give " + ", ".join(f"--{m}" for m in missing))
            s = Setting(args.numel, args.k, args.workers, args.union or args.k, args.compute)
            info = {}
        rates = [parse_rate(b) for b in (args.bandwidth or ["1Gbit", "10Gbit"])]
        if args.cpu_share is not None and not 0 < args.cpu_share <= 1:
            raise ValueError(f"--cpu-share must be in (0, 1], got {args.cpu_share}")
        if min(args.server_cpu, args.worker_comm_cpu, args.worker_ps_cpu) < 0:
            raise ValueError("--server-cpu, --worker-comm-cpu and --worker-ps-cpu must be >= 0 "
                             "(ms)")
        if args.servers < 1 or (args.colocated and args.servers != s.workers):
            raise ValueError("--servers must be >= 1, and --colocated places one shard beside "
                             f"each worker: give --servers {s.workers}")
        if not args.shard_imbalance >= 1:
            raise ValueError("--shard-imbalance is the busiest shard's bytes over the mean "
                             f"shard's: >= 1, got {args.shard_imbalance}")
        s.servers, s.colocated, s.shard_imbalance = args.servers, args.colocated, \
            args.shard_imbalance
        if args.value_block < 1:
            raise ValueError(f"--value-block must be >= 1, got {args.value_block}")
        if args.run and args.values != "fp32":
            raise ValueError("--values with --run: the run's measured bytes are its own "
                             "format's already (give the sizes instead of --run to model "
                             "another format)")
        s.value_bytes = value_bytes_of(args.values, args.value_block)
        s.full_duplex = args.full_duplex
        s.cpu_share = args.cpu_share
        s.server_cpu_s, s.worker_comm_cpu_s = args.server_cpu / 1e3, args.worker_comm_cpu / 1e3
        s.worker_ps_cpu_s = args.worker_ps_cpu / 1e3
        if args.powersgd_rank is not None:
            if args.powersgd_rank < 1 or not args.model:
                raise ValueError("--powersgd-rank needs a rank >= 1 and --model")
            from ..training.ddp import powersgd_sizes  # (imports torch: only here)
            s.powersgd_entries = sum(powersgd_sizes(model_shapes(args.model),
                                                    args.powersgd_rank))
    except (OSError, ValueError, KeyError) as exc:
        p.error(str(exc))
    overhead = WIRE_OVERHEAD if args.wire_overhead else 1.0
    rows = {f"{r / 1e6:g} Mbit/s": predict(s, r, args.latency / 1000, overhead) for r in rates}
    if args.json:
        print(json.dumps({"setting": s.__dict__, **info, "predicted_s": rows}, indent=1))
        return 0
    print(f"n = {s.numel:,}, k = {s.k:,.0f}, N = {s.workers}, union = {s.union:,.0f} "
          f"({s.union / s.k:.2f} k), compute {s.compute_s * 1e3:.1f} ms/iteration"
          + (f"; run measured {info['measured_s'] * 1e3:.1f} ms/iteration"
             + (f" at {info['bandwidth']}" if info.get("bandwidth") else " (no pacing)")
             if info else ""))
    schemes = list(next(iter(rows.values())))
    print(f"{'ms per iteration':<22}" + "".join(f"{name:>22}" for name in schemes))
    for label, pred in rows.items():
        ring = pred["dense ring allreduce"]
        print(f"{label:<22}" + "".join(f"{pred[n] * 1e3:>13.2f} ({ring / pred[n]:.2f}x)"
                                       for n in schemes))
    print("(x: speed-up over dense ring allreduce)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
