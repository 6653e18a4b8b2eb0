"""Every run of every experiment sweep is a valid psparse-launch configuration."""

from __future__ import annotations

import pytest

from experiments.run import SWEEPS
from psparse.config import resolve_config
from psparse.launch import build_parser
from psparse.policies import Layout, build_policy


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_sweep_runs_parse_and_validate(sweep):
    runs = SWEEPS[sweep]["runs"]
    assert runs
    for name, args in runs.items():
        parsed = build_parser().parse_args(["--out", "x", *SWEEPS[sweep]["base"], *args])
        cfg = resolve_config(parsed)
        build_policy(cfg.policy, cfg.policy_args, Layout([100]), 5)  # parameters accepted
        assert cfg.workers == 8, name


def test_lenet_sweep_covers_the_issue():
    runs = SWEEPS["lenet-mnist"]["runs"]
    assert "dense" in runs and len(runs) == 1 + 2 * 2 * 9
    assert "core-d0.001-limit2k" in runs and "topk-d0.01" in runs
