"""The built-in models: LeNet-5 sized by its input (MNIST and CIFAR-10), shapes and sizes."""

from __future__ import annotations

import torch
from torch import nn

from psparse.data import IN_SHAPES
from psparse.training.models import LeNet5, build_model


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _MnistLeNetBefore(nn.Module):
    """LeNet-5 as psparse defined it before it took an input shape (issue 16): the MNIST
    results in experiments/ were made with these layers, built in this order."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)


def test_mnist_lenet_is_unchanged_same_size_and_same_initial_weights():
    for seed in (0, 3):
        torch.manual_seed(seed)
        before = _MnistLeNetBefore().state_dict()
        torch.manual_seed(seed)
        now = build_model("lenet", IN_SHAPES["mnist"], 10)
        torch.manual_seed(seed)
        default = LeNet5()
        assert list(now.state_dict()) == list(before)
        for name, tensor in before.items():
            assert torch.equal(now.state_dict()[name], tensor), name
            assert torch.equal(default.state_dict()[name], tensor), name
    assert count(now) == 61706
    assert now.conv1.padding == (2, 2)
    out = now(torch.randn(5, 1, 28, 28))
    assert out.shape == (5, 10)


def test_cifar_lenet_is_the_classic_lenet5():
    assert IN_SHAPES["cifar10"] == (3, 32, 32)
    torch.manual_seed(0)
    net = build_model("lenet", IN_SHAPES["cifar10"], 10)
    sizes = {name: p.numel() for name, p in net.named_parameters()}
    # conv 5x5 3->6 (no padding: 32 -> 28), pool, conv 5x5 6->16 (14 -> 10), pool to 16x5x5,
    # fc 400->120, 120->84, 84->10
    assert sizes == {"conv1.weight": 450, "conv1.bias": 6, "conv2.weight": 2400,
                     "conv2.bias": 16, "fc1.weight": 48000, "fc1.bias": 120,
                     "fc2.weight": 10080, "fc2.bias": 84, "fc3.weight": 840, "fc3.bias": 10}
    assert count(net) == 62006
    assert net.conv1.padding == (0, 0)
    x = torch.randn(4, 3, 32, 32)
    out = net(x)
    assert out.shape == (4, 10)
    # it trains: one backward pass reaches every parameter
    nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_lenet_refuses_the_wrong_number_of_channels():
    net = build_model("lenet", (1, 28, 28), 10)
    try:
        net(torch.randn(2, 3, 32, 32))
    except RuntimeError as e:
        assert "channels" in str(e)
    else:
        raise AssertionError("an MNIST LeNet accepted CIFAR-shaped input")
