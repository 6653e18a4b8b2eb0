"""Mixed precision with psparse: fp16 autocast with a GradScaler, or bf16 autocast without
one, a small CNN on scikit-learn's digits (docs/api.md, Mixed precision).

    psparse-launch --workers 2 examples/mixed_precision.py --precision fp16
    psparse-launch --workers 2 --granularity layer --overlap examples/mixed_precision.py

For tests/test_amp.py: --overflow-at R:T puts an inf into rank R's gradient at iteration T (an
fp16 overflow, forced); --dump DIR saves, per rank, the accumulator, the parameters and the
scale around that step; --init-scale sets the GradScaler's first scale.
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import psparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--overflow-at", default=None, metavar="RANK:ITER")
    p.add_argument("--dump", default=None)
    p.add_argument("--init-scale", type=float, default=2.0 ** 16)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    per = 1500 // world
    train_x, train_y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale) if args.precision == "fp16" else None
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    bad_rank, bad_it = map(int, args.overflow_at.split(":")) if args.overflow_at else (-1, -1)
    dump = {}
    # the scaler goes to connect: with --overlap (and the DDP hook) buckets leave during
    # backward, so psparse must know the scale before exchange()
    with psparse.connect(model, optimizer, iterations=args.iterations, scaler=scaler) as ps:
        for it in range(ps.iterations):
            b = slice((it * 32) % (per - 32), (it * 32) % (per - 32) + 32)
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(train_x[b]), train_y[b])
            if scaler is None:
                loss.backward()
                ps.exchange(loss)
                optimizer.step()
            else:
                if it == bad_it:  # before backward: with --overlap it already pushes buckets
                    dump.update(acc_before=host(ps, ps.memory.accumulator),
                                params_before=ps.net.params.clone().numpy(),
                                scale_before=scaler.get_scale())
                scaler.scale(loss).backward()
                if it == bad_it and rank == bad_rank:  # the first layer: pushed by exchange()
                    model[0].weight.grad[0, 0, 0, 0] = float("inf")
                ps.exchange(loss)  # unscaled, exchanged; .grad as scaler.step expects it
                scaler.step(optimizer)
                scaler.update()
                if it == bad_it:
                    dump.update(acc_after=host(ps, ps.memory.accumulator),
                                params_after=ps.net.params.clone().numpy(),
                                scale_after=scaler.get_scale())
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            acc = float((model(x[1500:]).argmax(1) == y[1500:]).float().mean())
        ps.close(test_acc=acc)
    if args.dump:
        np.savez(os.path.join(args.dump, f"amp-rank-{rank}.npz"), **dump)


def host(ps, array):
    """A copy of a psparse array on the host (on the GPU path through its backend's read)."""
    return ps.dev.read(array) if ps.dev is not None else array.copy()


if __name__ == "__main__":
    main()
