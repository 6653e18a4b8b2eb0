"""The GPU exchange's synchronisation discipline, proven on the CPU with real processes.

``PSPARSE_EMULATE_GPU=strict`` makes every worker run the GPU path (psparse/device_round.py) on
the strict emulated backend: the CUDA C kernels on the CPU and device arrays that raise
``HostSync`` on every implicit read to the host (``float()``, ``int()``, ``bool()``,
``.item()``, ``.get()``, ``np.asarray``, boolean masks, ``nonzero``...). A run that finishes
under it made only the crossings it counts (rank-R.json ``device``): one copy back per
iteration (two-phase policies one more per proposal they send, one per bucket of a round in
parts), and no other read. And it ends bit-identical to the host path's run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import REPO, python_module, read_jsonl

RUN = ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations", "12",
       "--eval-every", "6", "--seed", "5", "--quiet", "--threads", "1"]


def launch(out, *args, emulate: str | None = "strict", graph: bool = False,
           timeout: float = 240):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PSPARSE_EMULATE_GPU", "PSPARSE_CUDA_GRAPH")}
    if emulate:
        env["PSPARSE_EMULATE_GPU"] = emulate
    if graph:
        env["PSPARSE_CUDA_GRAPH"] = "1"
    env["PYTHONPATH"] = str(REPO / "tests")  # the planted policy
    return subprocess.run(python_module("psparse.launch", "--out", str(out), *RUN, *args),
                          capture_output=True, text=True, timeout=timeout, env=env)


def ranks(out):
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


POLICIES = ["topk", "randomk", "threshold", "frequency", "ema", "penalty", "core", "vote",
            "cltk"]


@pytest.mark.parametrize("policy", POLICIES)
def test_one_copy_back_per_message_and_the_host_paths_result(tmp_path, policy):
    args = ["--policy", policy, "--granularity", "layer", "--density", "0.05"]
    if policy == "threshold":
        args += ["--policy-arg", "lam=0.002"]
    device = launch(tmp_path / "device", *args)
    assert device.returncode == 0, device.stdout + device.stderr
    host = launch(tmp_path / "host", *args, emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    dev_ranks, host_ranks = ranks(tmp_path / "device"), ranks(tmp_path / "host")
    iterations = 12
    for rank, (d, h) in enumerate(zip(dev_ranks, host_ranks)):
        assert d["checksum"] == h["checksum"]  # bit-identical weights
        assert d["push_bytes"] == h["push_bytes"]
        crossings = d["device"]
        assert crossings["backend"] == "emulated-strict" and "device" not in h
        if policy == "vote":  # the proposal and the push: two messages, two copies back
            expected = 2 * iterations
        elif policy == "cltk":  # the leader (every other round here) also sends a proposal
            expected = iterations + sum(1 for it in range(iterations) if it % 2 == rank)
        else:
            expected = iterations
        assert crossings["copy_backs"] == expected, crossings
        assert crossings["reads"] == 0, crossings  # nothing else came back in a round
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert without_timing(read_jsonl(tmp_path / "device" / name)) == \
            without_timing(read_jsonl(tmp_path / "host" / name)), name


def test_a_planted_read_of_a_device_scalar_fails_the_run(tmp_path):
    """A policy that reads float(max) of the accumulator: fine on the host, a HostSync under
    the strict backend (on a GPU it would wait for the device every round)."""
    args = ["--policy", "planted_policy:ReadsTheMaximum"]
    host = launch(tmp_path / "host", *args, emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    device = launch(tmp_path / "device", *args)
    assert device.returncode != 0
    error = json.loads((tmp_path / "device" / "summary.json").read_text())["error"]
    assert "HostSync" in error and "float()" in error, error


@pytest.mark.parametrize("extra", [["--overlap", "--bucket-mb", "0.002"], ["--bucket-mb", "0.002"]],
                         ids=["overlap", "buckets"])
def test_rounds_in_parts_copy_back_once_per_part(tmp_path, extra):
    args = ["--policy", "core", "--granularity", "layer", "--density", "0.05", *extra]
    device = launch(tmp_path / "device", *args)
    assert device.returncode == 0, device.stdout + device.stderr
    host = launch(tmp_path / "host", *args, emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    for d, h in zip(ranks(tmp_path / "device"), ranks(tmp_path / "host")):
        assert d["checksum"] == h["checksum"]
        parts = len(d["overlap"]["parts"]) - 1
        assert parts > 1 and d["device"]["copy_backs"] == 12 * parts, d["device"]


@pytest.mark.parametrize("extra", [["--memory", "dgc", "--momentum", "0"],
                                   ["--memory", "scalecom", "--policy", "cltk"],
                                   ["--density", "1"]],
                         ids=["dgc", "scalecom", "dense"])
def test_memories_and_the_dense_round_on_the_device(tmp_path, extra):
    device = launch(tmp_path / "device", *extra)
    assert device.returncode == 0, device.stdout + device.stderr
    host = launch(tmp_path / "host", *extra, emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    for d, h in zip(ranks(tmp_path / "device"), ranks(tmp_path / "host")):
        assert d["checksum"] == h["checksum"]
        assert d["device"]["reads"] == 0


def test_a_device_run_resumes_exactly(tmp_path):
    """Checkpoints read the device state (outside the rounds); a resumed run uploads it and
    ends bit-identical to an uninterrupted one (ema: the decayed priority, its device scale,
    the per-slice maxima rebuilt)."""
    run = ["--policy", "ema", "--granularity", "layer", "--iterations", "60",
           "--checkpoint-every", "20"]
    whole = launch(tmp_path / "whole", *run)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    cut = tmp_path / "cut"
    env = dict(os.environ, PSPARSE_EMULATE_GPU="strict")
    proc = subprocess.Popen(python_module("psparse.launch", "--out", str(cut), *RUN, *run),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    while not ((cut / "checkpoint" / "server-40.pt").is_file()
               and len(read_jsonl(cut / "metrics.jsonl")) >= 45):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    resumed = subprocess.run(python_module("psparse.launch", "--resume", str(cut), "--quiet"),
                             capture_output=True, text=True, timeout=240, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at iteration 40" in (cut / "logs" / "server.log").read_text()
    for a, b in zip(ranks(cut), ranks(tmp_path / "whole")):
        assert a["checksum"] == b["checksum"] and a["policy_state"] == b["policy_state"]
    assert without_timing(read_jsonl(cut / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))


@pytest.mark.parametrize("policy", ["core", "frequency"])
def test_selection_as_a_graph_replays_what_launch_by_launch_runs(tmp_path, policy):
    """PSPARSE_CUDA_GRAPH=1 (on a GPU: the default up to 1M parameters): from the second
    round at each budget the selection is one recorded graph, replayed. Under the emulator a
    capture records the kernels and refuses any other device work, as a CUDA graph would not
    replay it: the run must still equal the host's, through a density warm-up's budget
    changes."""
    args = ["--policy", policy, "--granularity", "layer", "--iterations", "60",
            "--density-warmup", "1"]
    device = launch(tmp_path / "device", *args, graph=True)
    assert device.returncode == 0, device.stdout + device.stderr
    host = launch(tmp_path / "host", *args, emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    budgets = {row["budget"] for row in read_jsonl(tmp_path / "host" / "metrics.jsonl")}
    assert len(budgets) > 1  # the warm-up changed the budget during the run
    for d, h in zip(ranks(tmp_path / "device"), ranks(tmp_path / "host")):
        assert d["checksum"] == h["checksum"]
        assert d["device"]["graph_rounds"] == 60 - len(budgets), d["device"]  # 1 eager each
        assert d["device"]["copy_backs"] == 60


def test_the_strict_device_arrays_refuse_every_implicit_way_to_the_host():
    import numpy as np

    from psparse.backend import EmulatedBackend, HostSync
    dev = EmulatedBackend(strict=True)
    xp = dev.xp
    a = dev.upload("a", np.arange(10, dtype=np.float32))
    scalar = a.max()
    refused = {
        "bool()": lambda: bool(scalar), "int()": lambda: int(scalar),
        "float()": lambda: float(scalar), "an index": lambda: [0, 1][a[1:2].astype(np.int64)],
        ".item()": lambda: scalar.item(), ".get()": lambda: a.get(),
        ".tolist()": lambda: a.tolist(), "np.asarray": lambda: np.asarray(a),
        "iterating": lambda: list(a), "boolean-mask indexing": lambda: a[a > 3],
        ".nonzero()": lambda: a.nonzero(), "xp.flatnonzero()": lambda: xp.flatnonzero(a),
        "xp.unique()": lambda: xp.unique(a), "xp.partition()": lambda: xp.partition(a, 3),
        "a host numpy array mixed": lambda: a + np.ones(10, np.float32),
        "xp.asarray of host data": lambda: xp.asarray(np.ones(3)),
        "indexing a device array with a host array": lambda: a[np.array([1, 2])],
    }
    for what, attempt in refused.items():
        with pytest.raises(HostSync, match=what.split(" (")[0].replace("(", r"\(").replace(
                ")", r"\)")):
            attempt()
    # what a device allows: arithmetic, reductions to device scalars, gathers, metadata
    b = (a * 2 + 1)[dev.upload("i", np.array([1, 9], np.int64))]
    assert b.shape == (2,) and a.size == 10 and len(a) == 10
    assert dev.read(b).tolist() == [3.0, 19.0] and dev.reads == 1
    dev.copy_back([(scalar.reshape(1), out := np.zeros(1, np.float32))])
    assert out[0] == 9.0 and dev.copy_backs == 1
