"""tests/user_train.py's model and data in a loop that fails on purpose, for --max-restarts.

--fail-at T --fail-rank R: rank R raises a data error at iteration T, --fail-times N times in
all over the run's attempts (counted in a file of the run directory); comma-separated lists
(--fail-at 25,30 --fail-rank 1,0) make rank 1 fail at 25 and rank 0 at 30; --vary puts the count in
the message, so that each failure has another cause. --no-data: rank R fails before connecting. Batches are a function of the iteration
(as docs/api.md asks of a script that is to restart identically).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from user_train import Digits, Net, accuracy

import psparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--fail-at", default="")
    p.add_argument("--fail-rank", default="1")
    p.add_argument("--fail-times", type=int, default=1)
    p.add_argument("--vary", action="store_true")
    p.add_argument("--no-data", action="store_true", help="rank --fail-rank finds no data set")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fail_at = dict(zip(map(int, args.fail_rank.split(",")),
                       map(int, filter(None, args.fail_at.split(",")))))
    if args.no_data and rank == int(args.fail_rank):  # before it ever reaches the server
        raise FileNotFoundError("no data set at /nowhere/train.bin")
    train, test = Digits(rank, world, True), Digits(rank, world, False)
    per_epoch = len(train) // 16
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = Path(os.environ["PSPARSE_OUT"]) / f"faults-rank-{rank}.count"
    with psparse.connect(model, optimizer, iterations=args.iterations) as ps:
        for it in range(ps.start, ps.iterations):
            if it == fail_at.get(rank):
                failures = int(counter.read_text()) if counter.is_file() else 0
                if failures < args.fail_times:
                    counter.write_text(str(failures + 1))
                    raise RuntimeError(f"data error at iteration {it}"
                                       + (f" (failure {failures + 1})" if args.vary else ""))
            epoch, b = divmod(it, per_epoch)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
                1000 * epoch + rank))
            x, y = train[order[b * 16:(b + 1) * 16]]
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            ps.exchange(loss)
            optimizer.step()
            optimizer.zero_grad()
        ps.close(test_acc=accuracy(model, test))


if __name__ == "__main__":
    main()
