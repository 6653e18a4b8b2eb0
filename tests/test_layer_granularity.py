"""--granularity layer sends every tensor: LeNet-5's biases at 1% (a proportional share of
0.06-0.8 entries) get at least one entry every round, in a real 2-worker run."""

from __future__ import annotations

import subprocess

import numpy as np
from conftest import python_module


def test_every_tensor_is_sent_every_round_with_layer_granularity(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(python_module(
        "psparse.launch", "--out", str(out), "--quiet", "--workers", "2", "--model", "lenet",
        "--dataset", "mnist", "--density", "0.01", "--granularity", "layer", "--iterations",
        "15", "--eval-every", "0", "--eval-samples", "100", "--record-selections"),
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        rec = np.load(out / f"selections-rank-{rank}.npz")
        sizes = rec["layer_sizes"]
        edges = np.concatenate([[0], np.cumsum(sizes)])
        names = list(rec["layer_names"])
        assert {"conv1.bias", "conv2.bias", "fc3.bias"} <= set(names)
        for t in range(15):
            sent = rec["sent"][rec["sent_offsets"][t]:rec["sent_offsets"][t + 1]]
            per_layer = np.histogram(sent, bins=edges)[0]
            assert per_layer.min() >= 1, (t, dict(zip(names, per_layer.tolist())))
            assert per_layer.sum() == 617
