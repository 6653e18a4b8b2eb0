"""A DistributedDataParallel script with psparse as its communication: LeNet-5 on MNIST.

    psparse-launch --workers 4 --policy topk --density 0.01 examples/ddp_hook.py --iterations 300

or without the launcher, as torchrun starts it (psparse-server running on node0:5555):

    PSPARSE_SERVER=node0:5555 torchrun --nproc-per-node 4 examples/ddp_hook.py

The one psparse line is marked  # psparse; without it this is plain DDP (gloo on the CPU).
``--api session`` trains the same with ``psparse.connect`` and ``ps.exchange()`` instead of
DDP (the comparison in docs/api.md and tests/test_ddp_hook.py).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import psparse
import psparse.ddp_hook
from psparse.data import load_dataset


def lenet():
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                         nn.Linear(84, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=["ddp", "session"], default="ddp")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = load_dataset("mnist")
    x = (torch.from_numpy(data.train_x).float() / 255 - data.mean[0]) / data.std[0]
    y = torch.from_numpy(data.train_y).long()
    test_x = (torch.from_numpy(data.test_x[:2000]).float() / 255 - data.mean[0]) / data.std[0]
    test_y = torch.from_numpy(data.test_y[:2000]).long()
    share = len(y) // world  # this rank's equal share
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = lenet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.api == "ddp":
        dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        net = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        ps = psparse.ddp_hook.register(net, optimizer, iterations=args.iterations)  # psparse
    else:
        net = model
        ps = psparse.connect(model, optimizer, iterations=args.iterations,
                             granularity="layer", bucket_mb=0.1)
    order = torch.randperm(share, generator=torch.Generator().manual_seed(args.seed + rank))
    with ps:
        for it in range(args.iterations):
            batch = order[(it * args.batch_size) % (share - args.batch_size):][:args.batch_size]
            loss = F.cross_entropy(net(x[batch]), y[batch])
            loss.backward()  # with DDP: the hook exchanges the buckets through the server
            if args.api == "session":
                ps.exchange()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
        ps.close(test_acc=accuracy)


if __name__ == "__main__":
    main()
