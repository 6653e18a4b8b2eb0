"""The synthetic load-test model: its size, its gradient's heavy tail, its options' errors, and a
real two-worker run through psparse-launch that reports its bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from psparse.config import MODEL_ARGS, ConfigError, RunConfig
from psparse.training.models import SYNTHETIC_ARGS, build_model, parse_count

DIGITS = (1, 8, 8)


def bulk_gradient(model, x, y) -> np.ndarray:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.bulk]).double().numpy()


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(32, *DIGITS, generator=gen), torch.randint(0, 10, (32,), generator=gen)


def top_share(g: np.ndarray, fraction: float = 0.01) -> float:
    """Share of the squared norm held by the largest ``fraction`` of the entries."""
    sq = np.sort(g * g)[::-1]
    return float(sq[:int(fraction * g.size)].sum() / sq.sum())


def test_sizes_are_exact_and_the_launcher_sizes_it_without_memory():
    model = build_model("synthetic", DIGITS, 10, {"numel": "1M"})
    assert sum(p.numel() for p in model.parameters()) == 1_000_000
    assert model.head.weight.shape == (10, 64)
    assert [tuple(p.shape) for p in model.bulk][:4] == [(520, 1024), (260, 1024), (130, 1024),
                                                        (65, 1024)]
    for numel, shape in (("11.2M", (1, 28, 28)), ("25M", (3, 32, 32)), ("100M", DIGITS),
                         ("2_500", DIGITS)):
        with torch.device("meta"):  # what psparse-launch does before starting anything
            m = build_model("synthetic", shape, 10, {"numel": numel, "layers": "3"})
        assert sum(p.numel() for p in m.parameters()) == parse_count("numel", numel)
        assert all(p.device.type == "meta" for p in m.parameters())
    assert set(SYNTHETIC_ARGS) == set(MODEL_ARGS["synthetic"])


def test_gradient_is_heavy_tailed_persistent_and_a_function_of_the_batch():
    torch.manual_seed(0)
    model = build_model("synthetic", DIGITS, 10, {"numel": "1M"})
    x1, y1 = batch(1)
    x2, y2 = batch(2)
    g1, g2 = bulk_gradient(model, x1, y1), bulk_gradient(model, x2, y2)
    assert np.count_nonzero(g1) == g1.size  # every entry gets a gradient
    gauss = np.random.default_rng(0).standard_normal(g1.size)
    for g in (g1, g2):
        kurtosis = float(((g - g.mean()) ** 4).mean() / g.var() ** 2 - 3)  # excess
        share = top_share(g)
        print(f"top 1% share {share:.3f} (Gaussian {top_share(gauss):.3f}), excess kurtosis "
              f"{kurtosis:.0f}, rms {np.sqrt((g * g).mean()):.2e}")
        assert 0.5 < share < 0.8 and top_share(gauss) < 0.1  # LeNet-5/MNIST: 0.64
        assert kurtosis > 50  # a Gaussian's is 0
        assert np.sqrt((g * g).mean()) == pytest.approx(1e-3, rel=0.1)  # scale
    # the same batch gives the same gradient (a fresh model from the same seed too) ...
    np.testing.assert_array_equal(bulk_gradient(model, x1, y1), g1)
    np.testing.assert_array_equal(bulk_gradient(build_model(
        "synthetic", DIGITS, 10, {"numel": "1M"}), x1, y1), g1)
    # ... another batch another draw, but the same entries tend to be large
    assert not np.array_equal(g1, g2)
    k = g1.size // 100
    top1, top2 = (set(np.argpartition(-np.abs(g), k)[:k].tolist()) for g in (g1, g2))
    assert len(top1 & top2) / k > 0.2  # about a third; independent sets would share 1%
    # the head trains on the data: its gradient is the read-out's, untouched
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x1), y1).backward()
    head = torch.nn.Linear(64, 10)
    head.load_state_dict(model.head.state_dict())
    F.cross_entropy(head(x1.flatten(1)), y1).backward()
    assert torch.equal(head.weight.grad, model.head.weight.grad)
    # evaluation: no synthetic gradient machinery at all
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x1), model.head(x1.flatten(1)))


@pytest.mark.parametrize("args, message", [
    ({"numel": "abc"}, "model-arg numel='abc': expected a positive whole number"),
    ({"numel": "0"}, "model-arg numel='0'"),
    ({"numel": "1.5"}, "model-arg numel='1.5'"),
    ({"numel": "600"}, "needs more than its 650-entry read-out head"),
    ({"layers": "0"}, "model-arg layers='0'"),
    ({"layers": "40"}, "layers=40: at most 16"),
    ({"tail": "-1"}, "model-arg tail='-1': expected a non-negative number"),
    ({"scale": "0"}, "model-arg scale='0': expected a positive number"),
    ({"scale": "nan"}, "model-arg scale='nan'"),
    ({"seed": "x"}, "model-arg seed='x': expected an integer"),
    ({"width": "3"}, "model-arg 'width' unknown for model 'synthetic'; it takes numel, "
                     "layers, tail, scale, seed"),
])
def test_bad_model_args_are_refused_naming_them(args, message):
    with pytest.raises(ConfigError) as err:
        build_model("synthetic", DIGITS, 10, args)
    assert message in str(err.value)


def test_model_args_in_the_configuration():
    cfg = RunConfig(model="synthetic", model_args=["numel=25M", "seed=3"]).validate()
    assert cfg.model_kwargs() == {"numel": "25M", "seed": "3"}
    assert cfg.agreed()["model_args"] == ["numel=25M", "seed=3"]  # every rank must agree
    for kwargs, message in (
            (dict(model="lenet", model_args=["numel=1M"]),
             "model 'lenet' takes no model-arg"),
            (dict(model="synthetic", model_args=["numel"]),
             "model-arg entries must be key=value, got 'numel'"),
            (dict(model="synthetic", model_args=["size=1M"]),
             "model-arg 'size' unknown for model 'synthetic'")):
        with pytest.raises(ConfigError, match=message):
            RunConfig(**kwargs).validate()


def test_a_factory_gets_the_model_args_as_keywords(tmp_path, monkeypatch):
    (tmp_path / "sized_factories.py").write_text(textwrap.dedent("""
        from torch import nn

        def wide(in_shape, num_classes, width="8"):
            return nn.Sequential(nn.Flatten(), nn.Linear(64, int(width)),
                                 nn.Linear(int(width), num_classes))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("sized_factories:wide", DIGITS, 10, {"width": "20"})
    assert model[1].out_features == 20
    with pytest.raises(ConfigError, match=r"cannot be called as factory\(in_shape, "
                                          r"num_classes, depth=\.\.\.\)"):
        build_model("sized_factories:wide", DIGITS, 10, {"depth": "3"})


def launch(out, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
                           *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.long
def test_two_workers_train_a_million_entry_synthetic_model_and_report_bytes(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--model", "synthetic", "--model-arg",
               "numel=1M", "--dataset", "digits", "--iterations", "20", "--eval-every", "0",
               "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    print({k: summary[k] for k in ("numel", "k", "upload_mb", "broadcast_mb",
                                   "union_over_k_mean", "train_iterations_per_s")})
    assert summary["status"] == "ok" and summary["iterations"] == 20
    assert summary["numel"] == 1_000_000 and summary["k"] == 10_000
    assert config["model"] == "synthetic" and config["model_args"] == ["numel=1M"]
    # 2 workers x 20 pushes of 10,000 entries: at least 1.6 MB of indices and values up
    assert summary["upload_mb"] > 2 * 20 * 10_000 * 5 / 1e6
    # the workers' heavy tails share their large entries, but not all: 1 < union/k < 2
    assert 1.2 < summary["union_over_k_mean"] < 1.95
    assert summary["broadcast_mb"] > 0 and summary["test_acc"] is not None


def test_the_launcher_refuses_bad_model_args_before_starting(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--model", "synthetic", "--model-arg",
               "numel=lots", "--dataset", "digits", "--iterations", "2", timeout=120)
    assert r.returncode == 2
    assert "model-arg numel='lots': expected a positive whole number" in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
