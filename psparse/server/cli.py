"""``psparse-server``'s command line: one server (or one key-range shard) for N workers.

psparse-server's command line: ``psparse-server --workers N --port P --out DIR`` (every flag:
docs/cli.md)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..config import SERVER_CONFIG
from ..options import add_config_arguments, parse_with_config
from ..wire import keyranges
from ..wire.transport import Pacer, is_loopback, parse_rate, warn
from .membership import RunAborted
from .server import Server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psparse-server",
        description="Run the psparse parameter server for one training run: waits for "
                    "--workers workers to register, aggregates their sparse pushes every "
                    "iteration, and writes metrics.jsonl, eval.jsonl and summary.json to --out.")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; anything else is reachable "
                        "by other hosts and prints a warning)")
    p.add_argument("--port", type=int, default=5555,
                   help="TCP port (default 5555; 0 picks a free one, written to OUT/server.port)")
    p.add_argument("--out", type=Path, default=None, help="run directory for metrics files")
    p.add_argument("--world-size", type=int, dest="workers", default=None,
                   help="alias of --workers")
    add_config_arguments(p, only=SERVER_CONFIG)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="admit only workers that prove this secret in their register (HMAC; "
                        "default: $PSPARSE_TOKEN; none: any peer that reaches the port may "
                        "register). psparse-launch generates one per run")
    p.add_argument("--shard", default="0/1", metavar="I/S",
                   help="serve key range I of S (0-based; default 0/1, the whole model): "
                        "[I*numel//S, (I+1)*numel//S) of the flat parameter vector, files in "
                        "OUT/shard-I/; start one server per shard and give the workers every "
                        "shard's address, in order (docs/protocol.md, Server shards)")
    return p


def main(argv=None) -> int:
    args, cfg = parse_with_config(build_parser(), argv)
    run_token = args.run_token or os.environ.get("PSPARSE_TOKEN") or None
    try:
        shard = keyranges.parse_shard(args.shard)
    except ValueError as exc:
        build_parser().error(str(exc))
    if not is_loopback(args.bind) and not cfg.curve_keys:
        warn(f"binding {args.bind}: traffic is not encrypted and "
             + ("only the run token guards admission" if run_token else
                "the server accepts workers from any host that reaches this port (no "
                "authentication; use --curve-keys, or at least --run-token)"))
    try:
        server = Server(cfg.workers, bind=args.bind, port=args.port, out_dir=args.out,
                        timeout=cfg.timeout, max_message_bytes=int(cfg.max_message_mb * 1e6),
                        limit=cfg.server_limit, curve_keys=cfg.curve_keys,
                        elastic=cfg.elastic, register_timeout=cfg.register_timeout,
                        checkpoint_every=cfg.checkpoint_every, resume=args.resume,
                        device=cfg.server_device, run_token=run_token, shard=shard)
        if cfg.bandwidth:
            server.link = Pacer(parse_rate(cfg.bandwidth))
    except (OSError, ValueError) as exc:
        print(f"psparse-server: error: {exc}", file=sys.stderr)
        return 1
    def on_term(signum, frame):  # the launcher stops us: still leave a summary behind
        raise RunAborted(f"terminated by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return server.run()
    except ValueError as exc:  # e.g. --resume without a usable checkpoint
        print(f"psparse-server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
