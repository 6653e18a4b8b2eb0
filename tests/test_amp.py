"""Mixed precision on real processes (psparse.worker.amp): bf16 autocast, and fp16 autocast with a
GradScaler whose step overflows on one rank, through psparse-launch (examples/mixed_precision.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import read_jsonl, run_launch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mixed_precision.py"


def launch(out: Path, *args: str, policy=(), env=None) -> dict:
    r = run_launch("--workers", "2", "--quiet", *policy,
                   "--out", str(out), str(EXAMPLE), *args,
                   timeout=300, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.mark.long
def test_bf16_autocast_trains(tmp_path):
    summary = launch(tmp_path / "run", "--precision", "bf16", "--iterations", "40")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["status"] == "ok" and len(rows) == 40
    assert not any(r["overflow"] for r in rows)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"] and summary["test_acc"] > 0.5


FORMS = {"whole": (), "buckets": ("--granularity", "layer", "--bucket-mb", "0.001"),
         "overlap": ("--granularity", "layer", "--bucket-mb", "0.001", "--overlap")}


@pytest.mark.long  # (all of test_amp: make test-isa runs it twice, with oneDNN capped)
@pytest.mark.parametrize("form", list(FORMS))
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, form):
    """Rank 1's gradient is inf at iteration 3: the round is flagged, nobody applies
    anything, every accumulator is as before the step, every scale halves, the run goes on
    (the server's final checksum comparison passes: status ok). In a round in buckets of
    layers (with --overlap, pushed during backward) only the overflowing bucket is empty;
    the others travel and are dropped by every rank, as the flag of one part skips the step."""
    summary = launch(tmp_path / "run", "--overflow-at", "1:3", "--dump", str(tmp_path),
                     policy=FORMS[form])
    assert summary["status"] == "ok", summary["error"]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["overflow"] for r in rows] == [it == 3 for it in range(12)]
    if form == "whole":
        assert rows[3]["k"] == [52, 0] and rows[3]["union"] == 0
    else:  # rank 1 sent its other buckets; the first layer's (where the inf is) is empty
        assert 0 < rows[3]["k"][1] < rows[3]["k"][0]
    assert rows[4]["union"] > 0  # the next round is an ordinary one
    for rank in (0, 1):
        d = np.load(tmp_path / f"amp-rank-{rank}.npz")
        assert np.array_equal(d["acc_before"], d["acc_after"])
        assert np.abs(d["acc_before"]).sum() > 0  # a real accumulator, restored
        assert np.array_equal(d["params_before"], d["params_after"])  # the step was skipped
        assert (d["scale_before"], d["scale_after"]) == (65536.0, 32768.0)
    finals = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text())["checksum"]
              for r in (0, 1)]
    assert finals[0] == finals[1]
    # The exchange sees unscaled gradients: the same run with the scale 1 makes the same
    # updates up to fp16 rounding in the scaled backward (fed scaled gradients, the run above
    # would step 2^16 times further and its loss leave this one's at iteration 1)
    launch(tmp_path / "scale-1", "--init-scale", "1", "--iterations", "4", policy=FORMS[form])
    unscaled = [r["loss"] for r in read_jsonl(tmp_path / "scale-1" / "metrics.jsonl")]
    assert np.allclose([r["loss"] for r in rows[:4]], unscaled, rtol=2e-3)


@pytest.mark.long
def test_a_two_phase_round_skips_too(tmp_path):
    """vote: the overflowing rank proposes nothing, the others' proposals are answered, and
    the push round is skipped."""
    summary = launch(tmp_path / "run", "--overflow-at", "0:2",
                     policy=("--policy", "vote", "--policy-arg", "keep=1.5"))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["status"] == "ok", summary["error"]
    assert [r["overflow"] for r in rows] == [it == 2 for it in range(12)]


@pytest.mark.long
@pytest.mark.parametrize("form", ["whole", "buckets"])
def test_the_gpu_path_skips_the_same_step_bit_for_bit_with_no_extra_synchronisation(
        tmp_path, form):
    """The GPU path under a GradScaler (on the strict emulated device, which refuses every
    read to the host but the backend's): the gradient is unscaled on the device, its
    finiteness comes back with the round's one copy (one per message: 12 rounds, 3 buckets
    each in parts), the overflowing step is skipped with the memory restored on the device,
    and the run is the host run's, bit for bit."""
    runs = {}
    for device in ("host", "gpu"):
        out = tmp_path / device
        dump = tmp_path / f"{device}-dump"
        dump.mkdir()
        env = {"PSPARSE_EMULATE_GPU": "strict"} if device == "gpu" else {}
        runs[device] = launch(out, "--overflow-at", "1:3", "--dump", str(dump),
                              policy=FORMS[form], env=env)
        assert runs[device]["status"] == "ok", runs[device]["error"]
        for rank in (0, 1):
            d = np.load(dump / f"amp-rank-{rank}.npz")
            assert np.array_equal(d["acc_before"], d["acc_after"])
            assert (d["scale_before"], d["scale_after"]) == (65536.0, 32768.0)
    report = json.loads((tmp_path / "gpu" / "rank-0.json").read_text())
    assert report["device"]["copy_backs"] == 12 * (1 if form == "whole" else 3)
    checksums = {d: json.loads((tmp_path / d / "rank-0.json").read_text())["checksum"]
                 for d in runs}
    assert checksums["gpu"] == checksums["host"]
    rows = {d: [r["overflow"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in runs}
    assert rows["gpu"] == rows["host"] == [it == 3 for it in range(12)]
