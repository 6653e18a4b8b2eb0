"""A user's script for the loops people write (tests/test_user_loops.py): open-ended runs that a
rank stops, epochs of different lengths on different ranks, gradient accumulation, and the
misuses psparse must name.

    psparse-launch --workers 2 tests/user_loops.py --stop-at 37

Its model, data and batches are tests/user_train.py's (batches are functions of the iteration,
so a resumed run sees the same ones). Options:
  --stop-at N      open-ended (no iterations at connect); rank --stop-rank calls ps.stop() at
                   iteration N, before its exchange
  --iterations N   a fixed length instead (with --stop-at too: a stop before the end)
  --ragged         rank r's epoch has r more batches than rank 0's (epochs of any length)
  --accumulate M   M micro-batches per exchange, the first M - 1 in ps.accumulating()
  --fail-at N      rank 1 raises at iteration N (not when resuming)
  --misuse twice | no-close | bad-model
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from user_train import Digits, Net, accuracy

import psparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--stop-rank", type=int, default=0)
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--ragged", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--misuse", choices=["twice", "no-close", "bad-model"], default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train, test = Digits(rank, world, True), Digits(rank, world, False)
    batch_size = 16
    epoch_length = len(train) // batch_size - world + (rank if args.ragged else 0)

    def batch(it):  # a pure function of the iteration (exact resume)
        epoch, b = divmod(it, epoch_length)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
            1000 * epoch + rank))
        return train[order[b * batch_size:(b + 1) * batch_size]]

    torch.manual_seed(0)
    model = Net()
    if args.misuse == "bad-model" and rank == 1:
        model.fc.half()  # connect() refuses it: the cause must reach summary.json
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ps = psparse.connect(model, optimizer, iterations=args.iterations)
    if args.misuse == "no-close":
        train_loop(ps, model, optimizer, batch, epoch_length, args, rank, test)
        return  # forgot ps.close()
    with ps:
        evaluations = train_loop(ps, model, optimizer, batch, epoch_length, args, rank, test)
        ps.close(test_acc=accuracy(model, test))
    out = os.environ["PSPARSE_OUT"]
    np.save(os.path.join(out, f"params-{rank}.npy"),
            torch.cat([q.detach().flatten() for q in model.parameters()]).numpy())
    with open(os.path.join(out, f"loop-{rank}.txt"), "w") as f:
        f.write(f"iteration {ps.iteration} evaluations {evaluations}\n")


def train_loop(ps, model, optimizer, batch, epoch_length, args, rank, test) -> list[int]:
    """Epochs until the run ends; this rank evaluates after each of its own epochs."""
    evaluations = []
    while ps.running:
        for _ in range(epoch_length):
            it = ps.iteration
            if it == args.fail_at and rank == 1 and os.environ.get("PSPARSE_RESUME") != "1":
                raise RuntimeError(f"planted failure at iteration {it}")
            if it == args.stop_at and rank == args.stop_rank:
                ps.stop()
            x, y = batch(it)
            loss = step(ps, model, x, y, args.accumulate, it)
            ps.exchange(loss)
            if args.misuse == "twice" and it == 3:
                ps.exchange(loss)  # no backward since the last exchange: refused
            optimizer.step()
            optimizer.zero_grad()
            if not ps.running:
                break
        evaluations.append(ps.iteration)
        ps.log(test_acc=accuracy(model, test))
    return evaluations


def step(ps, model, x, y, micro: int, it: int):
    """Forward and backward over ``micro`` micro-batches; the mean loss."""
    if micro == 1:
        loss = F.cross_entropy(model(x, use_aux=it % 2 == 0), y)
        loss.backward()
        return loss
    xs, ys = x.chunk(micro), y.chunk(micro)
    total = 0.0
    with ps.accumulating():
        for xm, ym in zip(xs[:-1], ys[:-1]):
            loss = F.cross_entropy(model(xm, use_aux=it % 2 == 0), ym) / micro
            loss.backward()
            total += float(loss)
    loss = F.cross_entropy(model(xs[-1], use_aux=it % 2 == 0), ys[-1]) / micro
    loss.backward()
    return total + float(loss)


if __name__ == "__main__":
    main()
