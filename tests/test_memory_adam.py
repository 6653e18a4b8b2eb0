"""--memory adam: each worker's own Adam step, sent with error feedback, applied by plain SGD.

Checked against torch.optim.AdamW itself (everything sent: the same training to rounding),
against its conservation law (what was sent plus the accumulator is every local step, nothing
lost), and through a real server with the optimizer it needs and the one it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import psparse
from psparse.config import ADAM_BETAS, ConfigError
from psparse.ops.select import selection
from psparse.policies.memory import Memory


def adam_steps(grads: list[np.ndarray]) -> list[np.ndarray]:
    """torch.optim.Adam's steps (without the learning rate) for these gradients, in float64."""
    b1, b2, eps = ADAM_BETAS
    m = v = np.zeros_like(grads[0], dtype=np.float64)
    out = []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        out.append((m / (1 - b1 ** t)) / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps))
    return out


def test_the_accumulator_gains_adams_step_and_loses_nothing_of_it():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5_000).astype(np.float32) * rng.uniform(0.01, 10)
             for _ in range(12)]
    memory = Memory(5_000, "adam")
    sent = np.zeros(5_000)
    first = memory.add(grads[0]).copy()
    np.testing.assert_allclose(first, adam_steps(grads[:1])[0], rtol=2e-6)
    np.testing.assert_allclose(np.abs(first), 1.0, rtol=1e-4)  # Adam's first step: sign(g)
    memory.accumulator[...] = 0
    memory = Memory(5_000, "adam")
    for g in grads:
        acc = memory.add(g)
        idx = selection.topk_reference(acc, 50)  # 1%
        sent[idx] += memory.take(idx)
    # sum sent + what is left = every local Adam step (the memory's conservation law)
    np.testing.assert_allclose(sent + memory.accumulator, np.sum(adam_steps(grads), axis=0),
                               rtol=1e-5, atol=1e-5)
    assert memory.optimizer_momentum_applies is False
    assert set(memory.state_dict()) == {"accumulator", "first", "second", "powers"}
    with pytest.raises(ValueError, match="scalecom or adam memory bucket by bucket"):
        memory.add_range(grads[0][:10], 0, 10)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(),
                                        torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def batches(steps: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


def test_everything_sent_trains_as_torch_adamw_and_adamw_itself_is_refused(server_factory):
    steps, lr, wd = 6, 0.01, 0.1
    reference = Tiny()
    adamw = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=wd)
    for x, y in batches(steps):
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        adamw.step()
        adamw.zero_grad()

    model = Tiny()
    sgd = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)  # AdamW's decoupled decay
    server = server_factory(1)
    with psparse.connect(model, sgd, rank=0, world_size=1, iterations=steps, density=1.0,
                         memory="adam", server=f"127.0.0.1:{server.port}") as ps:
        for x, y in batches(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ps.exchange(loss)
            sgd.step()
            sgd.zero_grad()
    assert server.wait()[0] == 0
    moved = [(p - q).abs().max().item() for p, q in zip(reference.parameters(),
                                                        Tiny().parameters())]
    assert min(moved) > 2 * lr  # it trained: six Adam steps move each tensor up to 6 lr
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    with pytest.raises(ConfigError, match="memory 'adam' applies Adam in the accumulator: the "
                                          "optimizer must be plain SGD.*got AdamW"):
        psparse.connect(Tiny(), torch.optim.AdamW(Tiny().parameters()), rank=0, world_size=1,
                        iterations=5, memory="adam", server="127.0.0.1:1")
