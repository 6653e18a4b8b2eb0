"""The baseline users would pick instead: torch DistributedDataParallel, dense ring allreduce.

Same model, data shards, seed, batch size, optimizer and iteration count as a psparse run, so
the two are comparable line by line: ``psparse-launch --baseline ddp ...`` (gloo on CPU, NCCL
on GPU). Rank 0 writes the same run directory files; ``metrics.jsonl`` has ``allreduce_bytes``,
what a ring allreduce of the gradient moves per iteration summed over workers
(2 (N - 1) / N x 4 numel per worker), instead of the psparse server's counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .config import RunConfig, add_config_arguments, parse_with_config
from .rundir import EVAL_FILE, METRICS_FILE, SUMMARY_FILE, write_json
from .worker import setup
from .worker import train as train_loop


class AllreduceExchange:
    """The DDP baseline's side of the training loop (psparse.worker.train): DDP has already
    averaged the gradients during backward (ring allreduce), so ``exchange`` only averages the
    loss and records the round; rank 0 writes the run directory's files."""

    def __init__(self, cfg: RunConfig, rank: int, numel: int, iterations: int,
                 batches_per_epoch: int, out: Path, backend: str):
        self.cfg, self.rank, self.world = cfg, rank, cfg.workers
        self.start, self.iterations, self.iteration = 0, iterations, 0
        self.batches_per_epoch, self.out, self.backend = batches_per_epoch, out, backend
        self.is_evaluator = rank == 0
        self.numel = numel
        self.ring_bytes = int(2 * (self.world - 1) / self.world * 4 * numel * self.world)
        self.metrics = open(out / METRICS_FILE, "w") if rank == 0 else None
        self.evals = open(out / EVAL_FILE, "w") if rank == 0 else None
        self.last_eval = None
        self.t0 = self.t_round = time.perf_counter()

    def exchange(self, loss) -> None:
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if self.metrics:
            now = time.perf_counter()
            self.metrics.write(json.dumps({
                "iter": self.iteration, "workers": self.world,
                "allreduce_bytes": self.ring_bytes, "loss": mean_loss.item() / self.world,
                "round_s": round(now - self.t_round, 6), "time_s": round(now - self.t0, 6)})
                + "\n")
            self.metrics.flush()
            self.t_round = now
        self.iteration += 1

    def log(self, **values) -> None:
        if self.evals:
            self.last_eval = {"iter": self.iteration - 1, **values,
                              "time_s": round(time.perf_counter() - self.t0, 6)}
            self.evals.write(json.dumps(self.last_eval) + "\n")
            self.evals.flush()

    def close(self, **final) -> None:
        self.log(**final)
        dist.barrier()
        if self.rank != 0:
            return
        wall = time.perf_counter() - self.t0
        iterations, world, ring = self.iterations, self.world, self.ring_bytes
        write_json(self.out / SUMMARY_FILE, {
            "status": "ok", "error": None, "baseline": f"ddp ({self.backend})",
            "world_size": world, "numel": self.numel, "k": self.numel,
            "iterations": iterations, "wall_s": round(wall, 3),
            "iterations_per_s": round(iterations / wall, 3),
            "union_over_k_mean": None, "union_over_k_max": None,
            "upload_mb": round(iterations * ring / 2e6, 4),
            "broadcast_mb": round(iterations * ring / 2e6, 4),
            "dense_mb": round(iterations * 2 * world * self.numel * 4 / 1e6, 4),
            "final_loss": None, "test_acc": self.last_eval["test_acc"],
            "test_loss": self.last_eval["test_loss"], "rejected_messages": 0})
        self.metrics.close()
        self.evals.close()


def train(cfg: RunConfig, rank: int, port: int, out: Path) -> int:
    world = cfg.workers
    data, shard, model, _, device = setup(cfg, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout * 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    iterations = cfg.iterations or math.ceil(cfg.epochs * shard.batches_per_epoch)
    exchange = AllreduceExchange(cfg, rank, numel, iterations, shard.batches_per_epoch, out,
                                 backend)
    train_loop(cfg, exchange, model, opt, shard, data, device, forward=ddp)
    # No destroy_process_group(): with gloo it can hang when the other ranks are already
    # leaving (seen once in CI); the process ends right after, which releases everything.
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psparse.ddp",
                                description="One rank of the DistributedDataParallel baseline "
                                            "(started by psparse-launch --baseline ddp).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the process group's TCP port")
    p.add_argument("--out", type=Path, required=True)
    add_config_arguments(p)
    return p


def main(argv=None) -> int:
    args, cfg = parse_with_config(build_parser(), argv)
    return train(cfg, args.rank, args.port, args.out)


if __name__ == "__main__":
    sys.exit(main())
