"""A user's own training script for the API tests: BatchNorm CNN, Adam, own Dataset, own loop.

Run through psparse-launch (which sets RANK, WORLD_SIZE, PSPARSE_SERVER, ...):
    psparse-launch --workers 4 --policy core tests/user_train.py --iterations 40
--mismatch makes rank 1 build a wider model (the run must be refused, naming the difference).
--no-with leaves out the ``with`` block (close() called by hand).
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

import psparse


class Digits(Dataset):
    """scikit-learn's 8x8 digits, this rank's equal share (synchronous rounds need the same
    number of batches on every rank)."""

    def __init__(self, rank: int, world: int, train: bool):
        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        y = torch.tensor(y)
        cut = 1500
        x, y = (x[:cut], y[:cut]) if train else (x[cut:], y[cut:])
        if train:
            per = len(y) // world
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width * 16, 10)
        self.aux = nn.Linear(width * 16, 10)  # used on even iterations only: no grad on odd ones

    def forward(self, x, use_aux=False):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1)
        return self.fc(h) + (self.aux(h) if use_aux else 0)


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        pred = model(data.x).argmax(1)
    model.train()
    return float((pred == data.y).float().mean())


def test_loss(model, data):
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(data.x), data.y)
    model.train()
    return float(loss)


def evaluate(model, test, loss_only: bool) -> dict:
    return {"test_loss": test_loss(model, test)} if loss_only else \
        {"test_acc": accuracy(model, test)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--mismatch", action="store_true")
    p.add_argument("--no-with", action="store_true")
    p.add_argument("--loss-only", action="store_true",
                   help="evaluate as a language model would: a loss, no accuracy")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train, test = Digits(rank, world, True), Digits(rank, world, False)
    batches_per_epoch = len(train) // 16

    def batch(it):  # a pure function of the iteration, so a resumed run sees the same batches
        epoch, b = divmod(it, batches_per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
            1000 * epoch + rank))
        return train[order[b * 16:(b + 1) * 16]]

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net(width=12 if args.mismatch and rank == 1 else 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    ps = psparse.connect(model, optimizer, iterations=args.iterations,
                         batches_per_epoch=batches_per_epoch)
    with ps if not args.no_with else _Nothing():
        for it in range(ps.start, ps.iterations):
            x, y = batch(it)
            loss = F.cross_entropy(model(x, use_aux=it % 2 == 0), y)
            loss.backward()
            ps.exchange(loss)
            optimizer.step()
            optimizer.zero_grad()  # set_to_none: the next backward makes new tensors
            if (it + 1) % 10 == 0:
                ps.log(**evaluate(model, test, args.loss_only))
        ps.close(**evaluate(model, test, args.loss_only))
    np.save(os.path.join(os.environ["PSPARSE_OUT"], f"params-{rank}.npy"),
            torch.cat([q.detach().flatten() for q in model.parameters()]).numpy())
    bn = model.bn
    np.save(os.path.join(os.environ["PSPARSE_OUT"], f"bn-{rank}.npy"),
            np.concatenate([bn.running_mean.numpy(), bn.running_var.numpy(),
                            [float(bn.num_batches_tracked)]]))


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
