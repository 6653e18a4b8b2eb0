"""1-bit Adam's schedule: a dense warm-up (--dense-warmup), then AdamW's second moment frozen
(--freeze-variance, psparse.training.optim.FrozenVarianceAdamW).

Checked against torch.optim.AdamW itself (bit for bit until the freeze), against the update a
frozen variance makes (a fixed scaling of the momentum), through checkpoints (state_dict), and
through the launcher: the budget every worker sent, iteration by iteration, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_api import launch

from psparse.config import ConfigError, RunConfig
from psparse.training.optim import FrozenVarianceAdamW


def model_and_gradients(steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) * (0.1 + t) for p in model.parameters()]
             for t in range(steps)]
    return model, grads


def groups(model):
    """Two parameter groups, as a transformer user writes them (no decay on biases)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


def run(optimizer, model, grads):
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone()
        optimizer.step()


def test_until_the_freeze_it_is_torch_adamw_bit_for_bit_then_the_variance_stays():
    freeze, steps = 4, 9
    ours, grads = model_and_gradients(steps)
    theirs, _ = model_and_gradients(steps)
    frozen = FrozenVarianceAdamW(groups(ours), lr=0.01, freeze_after=freeze)
    adamw = torch.optim.AdamW(groups(theirs), lr=0.01, foreach=False)
    run(frozen, ours, grads[:freeze])
    run(adamw, theirs, grads[:freeze])
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(frozen.state[p]["exp_avg_sq"], adamw.state[q]["exp_avg_sq"])
    variance = {p: frozen.state[p]["exp_avg_sq"].clone() for p in ours.parameters()}
    before = {p: p.detach().clone() for p in ours.parameters()}

    run(frozen, ours, grads[freeze:freeze + 1])  # the first step after the freeze
    b1, b2 = 0.9, 0.999
    for name, p in ours.named_parameters():
        assert torch.equal(frozen.state[p]["exp_avg_sq"], variance[p])  # frozen
        decay = 0.1 if name.endswith("weight") else 0.0
        m = frozen.state[p]["exp_avg"]
        expected = before[p] * (1 - 0.01 * decay) - 0.01 / (1 - b1 ** (freeze + 1)) * m / (
            variance[p].sqrt() / (1 - b2 ** freeze) ** 0.5 + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    run(adamw, theirs, grads[freeze:freeze + 1])
    assert any(not torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))

    # a checkpoint mid-run: the restored optimizer goes on with the same bits
    state = copy.deepcopy(frozen.state_dict())  # (state_dict shares the tensors)
    run(frozen, ours, grads[freeze + 1:])
    resumed, _ = model_and_gradients(steps)
    run(FrozenVarianceAdamW(groups(resumed), lr=0.01, freeze_after=freeze), resumed,
        grads[:freeze + 1])
    restored = FrozenVarianceAdamW(groups(resumed), lr=0.01, freeze_after=freeze)
    restored.load_state_dict(state)
    run(restored, resumed, grads[freeze + 1:])
    for p, q in zip(ours.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs, message", [
    ({"freeze_after": 0}, "freeze_after must be a whole number of steps >= 1"),
    ({"freeze_after": 2.5}, "freeze_after must be a whole number"),
    ({"freeze_after": 3, "lr": 0}, "lr must be > 0"),
])
def test_the_optimizer_refuses_what_it_cannot_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "adamw", "freeze_variance": True}, "give its length with --dense-warmup N"),
    ({"freeze_variance": True, "dense_warmup": 5}, "it needs --optimizer adamw without"),
    ({"optimizer": "adamw", "memory": "adam", "freeze_variance": True, "dense_warmup": 5},
     "it needs --optimizer adamw without --memory adam"),
    ({"dense_warmup": 5, "density_warmup": 1.0}, "are two warm-ups: choose one"),
    ({"dense_warmup": -1}, "dense-warmup must be a whole number of iterations >= 0"),
])
def test_what_the_warm_up_options_refuse(options, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**options).validate()


def test_the_launcher_sends_everything_during_the_dense_warm_up_then_the_density(tmp_path,
                                                                               data_root):
    out = tmp_path / "run"
    r = launch(out, "--data-dir", str(data_root), "--workers", "2", "--optimizer", "adamw", "--lr", "1e-3", "--density",
               "0.01", "--dense-warmup", "3", "--freeze-variance", "--iterations", "6",
               "--eval-every", "0", "--eval-samples", "200", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    config = json.loads((out / "config.json").read_text())
    assert config["dense_warmup"] == 3 and config["freeze_variance"] is True
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    numel = summary["numel"]
    assert [m["budget"] for m in rounds] == [numel] * 3 + [round(0.01 * numel)] * 3
    # everything sent during the warm-up: the union is the whole model
    assert all(m["union"] == numel for m in rounds[:3])
    assert all(m["union"] < numel // 10 for m in rounds[3:])


def test_a_torch_adamw_checkpoint_loads_and_goes_on_as_the_same_steps():
    freeze, steps = 3, 6
    ours, grads = model_and_gradients(steps)
    theirs, _ = model_and_gradients(steps)
    adamw = torch.optim.AdamW(groups(theirs), lr=0.01, foreach=False)
    run(adamw, theirs, grads[:2])
    frozen = FrozenVarianceAdamW(groups(ours), lr=0.01, freeze_after=freeze)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        p.data.copy_(q.data)
    # (a copy: a loaded state_dict shares its tensors) AdamW's groups carry no freeze_after
    frozen.load_state_dict(copy.deepcopy(adamw.state_dict()))
    run(frozen, ours, grads[2:3])
    run(adamw, theirs, grads[2:3])  # step 3: still before the freeze, the same bits
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert all(g["freeze_after"] == freeze for g in frozen.param_groups)


def test_a_warm_up_that_would_not_be_dense_or_is_the_whole_run_is_refused():
    import psparse

    for policy, how in (("vote", "proposes first"), ("threshold", "chooses its own count")):
        with pytest.raises(ConfigError, match=f"policy '{policy}' {how}.*its warm-up would "
                                              "not be dense"):
            model, _ = model_and_gradients(1)
            psparse.connect(model, torch.optim.SGD(model.parameters(), lr=0.1), rank=0,
                            world_size=1, iterations=10, dense_warmup=3, policy=policy,
                            server="127.0.0.1:1")
    with pytest.raises(ConfigError, match="dense-warmup 10 covers the whole run of 10"):
        RunConfig(dense_warmup=10, iterations=10).validate()
