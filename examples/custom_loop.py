"""Your own training loop with psparse: a BatchNorm CNN trained with Adam on CIFAR-10.

    psparse-launch --workers 4 --policy core --density 0.01 examples/custom_loop.py --epochs 2

The psparse lines are marked  # psparse. Everything else is an ordinary PyTorch loop.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psparse  # psparse
from psparse.data import load_dataset


def net():
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]
    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.Flatten(),
                         nn.Linear(128 * 4 * 4, 10))


def tensors(x, y, mean, std):
    mean, std = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    return TensorDataset((torch.from_numpy(x).float() / 255 - mean) / std, torch.from_numpy(y))


def main(**psparse_options):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--iterations", type=int, default=None, help="stop after this many (tests)")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by the launcher
    data = load_dataset("cifar10")
    share = len(data.train_y) // world  # equal shares: every rank runs the same number of rounds
    part = slice(rank * share, (rank + 1) * share)
    train = tensors(data.train_x[part], data.train_y[part], data.mean, data.std)
    test = tensors(data.test_x, data.test_y, data.mean, data.std)
    loader = DataLoader(train, batch_size=32, shuffle=True, drop_last=True)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ps = psparse.connect(model, optimizer, batches_per_epoch=len(loader),  # psparse
                         iterations=args.iterations or int(args.epochs * len(loader)),
                         **psparse_options)
    with ps:  # psparse: an exception here is reported to the server, and the run ends cleanly
        while ps.iteration < ps.iterations:
            for x, y in loader:
                model.train()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                ps.exchange(loss)  # psparse: the aggregate is now in every p.grad
                optimizer.step()
                optimizer.zero_grad()
                if ps.iteration == ps.iterations:
                    break
            # psparse records only the evaluator's (rank 0's) values: the others skip the
            # 10,000 test images, and the last epoch is evaluated once, by close below
            if ps.is_evaluator and ps.iteration < ps.iterations:
                ps.log(test_acc=accuracy(model, test))  # psparse: into eval.jsonl
        final = {"test_acc": accuracy(model, test)} if ps.is_evaluator else {}
        ps.close(**final)  # psparse: the server writes summary.json


@torch.no_grad()
def accuracy(model, test):
    model.eval()  # BatchNorm's running statistics are this rank's own
    correct = sum(int((model(x).argmax(1) == y).sum())
                  for x, y in DataLoader(test, batch_size=1000))
    return correct / len(test)


if __name__ == "__main__":
    main()
