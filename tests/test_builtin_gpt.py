"""The built-in transformer: ``--model gpt --dataset text`` with ``--optimizer adamw``, through
the launcher on a real server, its data built from the standard library's source, and the
combinations it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_api import launch

from psparse.config import ConfigError, RunConfig
from psparse.data import load_dataset
from psparse.data.text import BLOCK, unigram_loss
from psparse.training.models import build_model


def test_the_text_data_is_next_character_prediction_on_the_standard_library():
    data = load_dataset("text")
    assert data.in_shape == (BLOCK,) and data.num_classes == 128
    assert data.train_x.dtype == np.uint8 and data.train_y.shape == data.train_x.shape
    # the targets are the inputs one character on, at every position
    np.testing.assert_array_equal(data.train_x[:, 1:], data.train_y[:, :-1])
    np.testing.assert_array_equal(data.test_x[:, 1:], data.test_y[:, :-1])
    assert int(data.train_x.max()) < 128 and len(data.test_x) > 1000
    assert data.normalise(torch.from_numpy(data.train_x[:2])).dtype == torch.int64  # token ids
    text = bytes(data.train_x[0]).decode("ascii")
    assert text.isprintable() or "\n" in text  # source code, not noise
    model = build_model("gpt", data.in_shape, data.num_classes)
    assert sum(p.numel() for p in model.parameters()) == 421_376  # the tied head counted once
    assert model.head.weight is model.tokens.weight
    logits = model(torch.from_numpy(data.train_x[:3]).long())
    assert logits.shape == (3, 128, BLOCK)  # (B, vocab, T): cross_entropy's layout


@pytest.mark.long
def test_gpt_with_adamw_learns_the_text_through_the_launcher(tmp_path):
    out = tmp_path / "run"
    r = launch(out, "--workers", "2", "--model", "gpt", "--dataset", "text", "--optimizer",
               "adamw", "--lr", "3e-3", "--batch-size", "16", "--weight-decay", "0.1",
               "--clip-aggregate", "1", "--density", "1", "--iterations", "80",
               "--eval-every", "0", "--eval-samples", "300", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["numel"] == 421_376
    config = json.loads((out / "config.json").read_text())
    assert config["optimizer"] == "adamw" and config["clip_aggregate"] == 1
    data = load_dataset("text")
    unigram = unigram_loss(data.train_x.ravel(), data.test_y.ravel())
    # from ln 128 = 4.85 nats at the start to below the unigram baseline (~3.05) in 80 steps
    assert summary["test_loss"] < unigram, (summary["test_loss"], unigram)
    assert 0.2 < summary["test_acc"] < 1  # per character; chance is 1/128


@pytest.mark.parametrize("options, message", [
    ({"model": "gpt", "dataset": "mnist"}, "model 'gpt' does not train on dataset 'mnist'"),
    ({"model": "lenet", "dataset": "text"}, "model 'lenet' does not train on dataset 'text'"),
    ({"model": "gpt", "dataset": "text", "memory": "adam", "clip_aggregate": 1.0},
     "the aggregate is an Adam step, not a gradient"),
    ({"optimizer": "adamw", "memory": "dgc"}, "memory dgc is SGD's momentum correction"),
    ({"optimizer": "adam"}, "optimizer must be one of sgd, adamw"),
    ({"model": "synthetic", "dataset": "text"}, "model 'synthetic' does not train on dataset"),
])
def test_what_the_transformer_options_refuse(options, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**options).validate()


def test_the_built_in_loop_with_the_adam_memory_says_adamw(tmp_path):
    r = launch(tmp_path / "run", "--workers", "2", "--model", "gpt", "--dataset", "text",
               "--memory", "adam", "--iterations", "5")
    assert r.returncode == 2 and "--memory adam takes each worker's Adam step: give " \
        "--optimizer adamw" in r.stderr, r.stderr
