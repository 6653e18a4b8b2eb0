"""Models: LeNet-5 (MNIST, CIFAR-10), ResNet-20 (CIFAR-10), and a tiny MLP for fast tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import plugin


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) for images of shape ``in_shape`` = (C, H, W).

    The classic geometry is a 32x32 input: conv 5x5 -> 6, pool, conv 5x5 -> 16, pool to 5x5,
    fc 120, 84, classes. Inputs smaller than 32 are zero-padded by conv1 up to it (MNIST's
    28x28 with padding 2, as before); 32x32 and larger are not padded, and fc1 takes what
    the second pooling leaves. Sizes:

    * (1, 28, 28) MNIST: 61,706 parameters, so density 1% means k = 617;
    * (3, 32, 32) CIFAR-10: 62,006 parameters (k = 620 at 1%).
    """

    def __init__(self, num_classes: int = 10, in_shape: tuple[int, int, int] = (1, 28, 28)):
        super().__init__()
        channels, height, width = in_shape
        pad = max(0, (32 - min(height, width) + 1) // 2)

        def after(size: int) -> int:  # conv1 (padded), pool, conv2, pool
            return ((size + 2 * pad - 4) // 2 - 4) // 2

        h, w = after(height), after(width)
        self.conv1 = nn.Conv2d(channels, 6, 5, padding=pad)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * h * w, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 colour images (He et al. 2016, CIFAR variant; ~0.27M parameters).

    Uses 1x1 projection shortcuts where the shape changes. BatchNorm running statistics are local
    to each worker (they are buffers, not gradients); evaluation uses rank 0's.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class MLP(nn.Module):
    """Two-layer perceptron for flat inputs (the 8x8 digits set in tests)."""

    def __init__(self, in_features: int = 64, hidden: int = 32, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


MODELS = {"lenet": LeNet5, "resnet20": ResNet20, "mlp": MLP}


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A built-in network by name, or ``package.module:factory`` called as
    ``factory(in_shape, num_classes)`` (in_shape = (C, H, W)); it must return an nn.Module."""
    if plugin.is_spec(name):
        model = plugin.load(name, "model factory")(tuple(in_shape), num_classes)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model factory {name!r} returned {type(model).__name__}, "
                             "expected a torch.nn.Module")
        return model
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if name == "mlp":
        n = 1
        for d in in_shape:
            n *= d
        return MLP(n, 32, num_classes)
    if name == "lenet":
        return LeNet5(num_classes, tuple(in_shape))
    return MODELS[name](num_classes)
