"""Whole runs with the compiled CPU kernels are identical to runs with the numpy references
they replaced (PSPARSE_CPU_KERNELS=numpy, psparse/ops/jit.py): real launches, every policy whose
server path differs (top-k, core, ema, frequency, and the two-phase vote and cltk), with the
size limit (--server-limit 2k) and two key-range shards (--servers 2). Compared: every
metrics.jsonl and eval.jsonl record without its timing fields, each rank's final checksum and
policy state, the server's residual, and the summary's figures."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import read_jsonl, start_launch

RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "16",
       "--eval-every", "8", "--seed", "3", "--quiet", "--server-limit", "2k", "--servers", "2"]
TIMING = ("round_s", "time_s", "wall_s", "train_s", "iterations_per_s",
          "train_iterations_per_s")
SUMMARY = ("status", "numel", "iterations", "union_over_k_mean", "union_over_k_max",
           "pushed_k_mean", "upload_mb", "broadcast_mb", "dense_mb", "server_limit",
           "final_loss", "test_acc")


POLICIES = ["topk", "core", "ema", "frequency", "vote", "cltk"]
AT_ONCE = 4  # launches running side by side (they share nothing but the machine)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every policy's run with the compiled kernels and with the references, launched four at
    a time: {(policy, "compiled" | "numpy"): run directory}."""
    root = tmp_path_factory.mktemp("identical")
    todo = [(policy, kernels) for policy in POLICIES for kernels in ("compiled", "numpy")]
    running, done = {}, {}
    while todo or running:
        while todo and len(running) < AT_ONCE:
            policy, kernels = todo.pop(0)
            env = {k: v for k, v in os.environ.items() if k != "PSPARSE_CPU_KERNELS"}
            if kernels == "numpy":
                env["PSPARSE_CPU_KERNELS"] = "numpy"
            out = root / f"{policy}-{kernels}"
            running[(policy, kernels)] = (out, start_launch("--out", str(out), *RUN,
                                                            "--policy", policy, env=env))
        key = next(iter(running))
        out, proc = running.pop(key)
        log, _ = proc.communicate(timeout=300)
        done[key] = (out, proc.returncode, log)
    return done


def untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_kernels_give_the_reference_run(runs, policy):
    for kernels in ("compiled", "numpy"):
        _, code, log = runs[(policy, kernels)]
        assert code == 0, f"{kernels}: {log}"
    ours, ref = runs[(policy, "compiled")][0], runs[(policy, "numpy")][0]
    metrics = untimed(read_jsonl(ours / "metrics.jsonl"))
    assert metrics == untimed(read_jsonl(ref / "metrics.jsonl"))
    assert untimed(read_jsonl(ours / "eval.jsonl")) == untimed(read_jsonl(ref / "eval.jsonl"))
    for r in range(3):
        a, b = (json.loads((run / f"rank-{r}.json").read_text()) for run in (ours, ref))
        assert (a["checksum"], a["policy_state"]) == (b["checksum"], b["policy_state"])
    for shard in range(2):
        a, b = (np.load(run / f"shard-{shard}" / "server_residual.npz") for run in (ours, ref))
        assert np.array_equal(a["indices"], b["indices"])
        assert a["values"].tobytes() == b["values"].tobytes()
    sa, sb = (json.loads((run / "summary.json").read_text()) for run in (ours, ref))
    assert {k: sa.get(k) for k in SUMMARY} == {k: sb.get(k) for k in SUMMARY}
    if policy == "topk":  # the limit held entries back: its path ran
        assert any(m["residual_entries"] for m in metrics)
