"""tests/user_train.py's model and data in a loop that fails on purpose, for --max-restarts.

--fail-at T --fail-rank R: rank R raises a data error at iteration T, --fail-times N times in
all over the run's attempts (counted in a file of the run directory); --vary puts the count in
the message, so that each failure has another cause. Batches are a function of the iteration
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
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-times", type=int, default=1)
    p.add_argument("--vary", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train, test = Digits(rank, world, True), Digits(rank, world, False)
    per_epoch = len(train) // 16
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = Path(os.environ["PSPARSE_OUT"]) / f"faults-rank-{rank}.count"
    with psparse.connect(model, optimizer, iterations=args.iterations) as ps:
        for it in range(ps.start, ps.iterations):
            if it == args.fail_at and rank == args.fail_rank:
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
