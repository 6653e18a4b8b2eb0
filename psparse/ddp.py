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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from .config import RunConfig, add_config_arguments, parse_with_config
from .data import Shard, load_dataset
from .models import build_model
from .worker import evaluate_model, pick_device


def train(cfg: RunConfig, rank: int, port: int, out: Path) -> int:
    world = cfg.workers
    device = pick_device(cfg.device, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout * 10))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
    data = load_dataset(cfg.dataset, cfg.data_dir)
    shard = Shard(data, rank, world, cfg.batch_size, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.in_shape, data.num_classes).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ring_bytes = int(2 * (world - 1) / world * 4 * numel * world)
    iterations = cfg.iterations or math.ceil(cfg.epochs * shard.batches_per_epoch)
    metrics = open(out / "metrics.jsonl", "w") if rank == 0 else None
    evals = open(out / "eval.jsonl", "w") if rank == 0 else None
    last_eval = None
    t0 = time.perf_counter()
    for it in range(iterations):
        t = time.perf_counter()
        ddp.train()
        x, y = shard.batch(it)
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
        loss.backward()  # DDP averages the gradients with a ring allreduce here
        if cfg.lr_steps:
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(it / shard.batches_per_epoch)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            metrics.write(json.dumps({
                "iter": it, "workers": world, "allreduce_bytes": ring_bytes,
                "loss": mean_loss.item() / world,
                "round_s": round(time.perf_counter() - t, 6),
                "time_s": round(time.perf_counter() - t0, 6)}) + "\n")
            metrics.flush()
            done = it + 1
            if done == iterations or (cfg.eval_every and done % cfg.eval_every == 0):
                last_eval = evaluate(model, data, device, it, shard.batches_per_epoch, t0)
                evals.write(json.dumps(last_eval) + "\n")
                evals.flush()
    dist.barrier()
    if rank == 0:
        wall = time.perf_counter() - t0
        summary = {
            "status": "ok", "error": None, "baseline": f"ddp ({backend})", "world_size": world,
            "numel": numel, "k": numel, "iterations": iterations, "wall_s": round(wall, 3),
            "iterations_per_s": round(iterations / wall, 3),
            "union_over_k_mean": None, "union_over_k_max": None,
            "upload_mb": round(iterations * ring_bytes / 2e6, 4),
            "broadcast_mb": round(iterations * ring_bytes / 2e6, 4),
            "dense_mb": round(iterations * 2 * world * numel * 4 / 1e6, 4),
            "final_loss": None, "test_acc": last_eval["test_acc"],
            "test_loss": last_eval["test_loss"], "rejected_messages": 0,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        metrics.close()
        evals.close()
    # No destroy_process_group(): with gloo it can hang when the other ranks are already
    # leaving (seen once in CI); the process ends right after, which releases everything.
    return 0


def evaluate(model, data, device, it: int, batches_per_epoch: int, t0: float) -> dict:
    test_loss, test_acc = evaluate_model(model, data, device)
    return {"iter": it, "epoch": round((it + 1) / batches_per_epoch, 4),
            "test_loss": test_loss, "test_acc": test_acc,
            "time_s": round(time.perf_counter() - t0, 6)}


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
