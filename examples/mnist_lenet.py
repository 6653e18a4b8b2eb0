"""What examples/open_ended.py and examples/compiled_groups.py share: a LeNet-5 and this rank's
share of MNIST as DataLoaders (an ordinary PyTorch model and data; nothing psparse here)."""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psparse.data import load_dataset


def lenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, 10))


def mnist(batch_size: int, train_samples: int | None = None, seed: int = 0):
    """(train loader over this rank's equal share, shuffled with a per-rank seed; test set as
    (x, y) tensors). The launcher sets RANK and WORLD_SIZE."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = load_dataset("mnist")
    x = (torch.from_numpy(data.train_x[:train_samples]).float() / 255 - data.mean[0]) / data.std[0]
    y = torch.from_numpy(data.train_y[:train_samples])
    share = len(y) // world
    part = slice(rank * share, (rank + 1) * share)
    loader = DataLoader(TensorDataset(x[part], y[part]), batch_size=batch_size, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(seed + rank))
    test_x = (torch.from_numpy(data.test_x).float() / 255 - data.mean[0]) / data.std[0]
    return loader, (test_x, torch.from_numpy(data.test_y))


@torch.no_grad()
def accuracy(model: nn.Module, test, samples: int | None = None) -> float:
    x, y = test
    x, y = x[:samples], y[:samples]
    model.eval()
    correct = sum(int((model(xb).argmax(1) == yb).sum())
                  for xb, yb in zip(x.split(1000), y.split(1000)))
    model.train()
    return correct / len(y)
