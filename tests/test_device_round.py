"""The GPU exchange's synchronisation discipline, proven on the CPU.

``PSPARSE_EMULATE_GPU=strict`` makes a worker run the GPU path (psparse/worker/device_round.py) on
the strict emulated backend: the CUDA C kernels on the CPU and device arrays that raise ``HostSync``
on every implicit read to the host (``float()``, ``int()``, ``bool()``, ``.item()``, ``.get()``,
``np.asarray``, boolean masks, ``nonzero``...). A run that finishes under it made only the crossings
it counts (the session's ``device`` report, rank-R.json): one copy back per iteration (two-phase
policies one more per proposal they send, one per bucket of a round in parts), and no other read.
And it ends bit-identical to the host path's run.

Most runs here are two ``psparse.connect`` sessions in threads of the test process against a
real server process (a user's loop, as docs/api.md shows it); the launcher's own path, a
planted read and a resume run as real worker processes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from conftest import REPO, ServerProcess, read_jsonl, run_launch, start_launch

import psparse
from psparse.worker.device_round import DeviceEngine

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
    return run_launch("--out", str(out), *RUN, *args, timeout=timeout, env=env)


def ranks(out):
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("round_s", "time_s")} for r in rows]


POLICIES = ["topk", "randomk", "threshold", "frequency", "ema", "penalty", "core", "vote",
            "cltk"]


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 10))


def train(port: int, rank: int, model, iterations: int, out, **options):
    """A user's loop through psparse.connect; (final weight checksum, the device report)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    with psparse.connect(model, optimizer, rank=rank, world_size=2, iterations=iterations,
                         server=f"127.0.0.1:{port}", out=str(out), **options) as ps:
        for _ in range(iterations):
            x, y = torch.randn(16, 64, generator=data), torch.randint(0, 10, (16,),
                                                                       generator=data)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ps.exchange(loss)  # a tensor: on the device path it is read with the round's copy
            optimizer.step()
            optimizer.zero_grad()
        report = ps.rounds.engine.report(iterations) \
            if isinstance(ps.rounds.engine, DeviceEngine) else None
        return ps.net.checksum(), report


def two_workers(out, monkeypatch, emulate: bool, iterations: int = 12, graph: bool = False,
                **options):
    """Two sessions in threads of this process against a real server process: the results of
    ``train`` per rank. ``emulate``: the GPU path on the strict emulated backend."""
    for name, on in (("PSPARSE_EMULATE_GPU", emulate), ("PSPARSE_CUDA_GRAPH", graph)):
        if on:
            monkeypatch.setenv(name, "strict" if name == "PSPARSE_EMULATE_GPU" else "1")
        else:
            monkeypatch.delenv(name, raising=False)
    server = ServerProcess(out, 2)
    models = [small_model(), small_model()]  # seeded one after the other, not in threads
    results, errors = [None, None], []

    def work(rank):
        try:
            results[rank] = train(server.port, rank, models[rank], iterations, out, **options)
        except BaseException as exc:  # shown by the assertion below
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    code, output = server.wait()
    assert not errors and code == 0, "\n".join(errors) + output
    return results


POLICY_OPTIONS = {"threshold": {"policy_args": {"lam": "0.002"}}}


@pytest.mark.parametrize("policy", POLICIES)
def test_one_copy_back_per_message_and_the_host_paths_result(tmp_path, monkeypatch, policy):
    options = {"policy": policy, "granularity": "layer", "density": 0.05,
               **POLICY_OPTIONS.get(policy, {})}
    device = two_workers(tmp_path / "device", monkeypatch, True, **options)
    host = two_workers(tmp_path / "host", monkeypatch, False, **options)
    iterations = 12
    for rank, ((dev_sum, crossings), (host_sum, none)) in enumerate(zip(device, host)):
        assert dev_sum == host_sum and none is None  # bit-identical weights
        assert crossings["backend"] == "emulated-strict"
        if policy == "vote":  # the proposal and the push: two messages, two copies back
            expected = 2 * iterations
        elif policy == "cltk":  # the leader (every other round here) also sends a proposal
            expected = iterations + sum(1 for it in range(iterations) if it % 2 == rank)
        else:
            expected = iterations
        assert crossings["copy_backs"] == expected, crossings
        assert crossings["reads"] == 0, crossings  # nothing else came back in a round
    assert without_timing(read_jsonl(tmp_path / "device" / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "host" / "metrics.jsonl"))


def test_the_launcher_runs_the_gpu_path_under_the_emulator(tmp_path):
    """PSPARSE_EMULATE_GPU reaches the workers and the server started by psparse-launch
    (--server-device cuda: the server's sums on the emulated device); rank-R.json says what
    crossed; the run equals the host path's."""
    device = launch(tmp_path / "device", "--policy", "core", "--server-device", "cuda")
    assert device.returncode == 0, device.stdout + device.stderr
    host = launch(tmp_path / "host", "--policy", "core", emulate=None)
    assert host.returncode == 0, host.stdout + host.stderr
    for d, h in zip(ranks(tmp_path / "device"), ranks(tmp_path / "host")):
        assert d["checksum"] == h["checksum"] and "device" not in h
        assert d["device"]["copy_backs_per_iteration"] == 1.0 and d["device"]["reads"] == 0
    assert without_timing(read_jsonl(tmp_path / "device" / "eval.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "host" / "eval.jsonl"))


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


def test_rounds_in_parts_copy_back_once_per_part(tmp_path, monkeypatch):
    """--overlap: each bucket's part pushed from an autograd hook, its own copy back."""
    options = {"policy": "core", "granularity": "layer", "density": 0.05, "overlap": True,
               "bucket_mb": 0.005}
    device = two_workers(tmp_path / "device", monkeypatch, True, **options)
    host = two_workers(tmp_path / "host", monkeypatch, False, **options)
    parts = len(json.loads((tmp_path / "device" / "rank-0.json").read_text())["overlap"]
                ["parts"]) - 1
    assert parts > 1
    for (dev_sum, crossings), (host_sum, _) in zip(device, host):
        assert dev_sum == host_sum
        assert crossings["copy_backs"] == 12 * parts, crossings


@pytest.mark.parametrize("options", [{"memory": "scalecom", "policy": "cltk"},
                                     {"memory": "dgc", "momentum": 0.0},
                                     {"density": 1.0}],
                         ids=["scalecom", "dgc", "dense"])
def test_memories_and_the_dense_round_on_the_device(tmp_path, monkeypatch, options):
    device = two_workers(tmp_path / "device", monkeypatch, True, **options)
    host = two_workers(tmp_path / "host", monkeypatch, False, **options)
    for (dev_sum, crossings), (host_sum, _) in zip(device, host):
        assert dev_sum == host_sum
        led = 6 * (options.get("policy") == "cltk")  # a leader's proposals (every other round)
        assert crossings["reads"] == 0 and crossings["copy_backs"] == 12 + led, crossings


@pytest.mark.long
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
    proc = start_launch("--out", str(cut), *RUN, *run, env=env)
    deadline = time.monotonic() + 120
    while not ((cut / "checkpoint" / "server-40.pt").is_file()
               and len(read_jsonl(cut / "metrics.jsonl")) >= 45):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    resumed = run_launch("--resume", str(cut), "--quiet", timeout=240, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at iteration 40" in (cut / "logs" / "server.log").read_text()
    for a, b in zip(ranks(cut), ranks(tmp_path / "whole")):
        assert a["checksum"] == b["checksum"] and a["policy_state"] == b["policy_state"]
    assert without_timing(read_jsonl(cut / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))


@pytest.mark.parametrize("policy", ["core", "frequency", "ema"])
def test_selection_as_a_graph_replays_what_launch_by_launch_runs(tmp_path, monkeypatch, policy):
    """PSPARSE_CUDA_GRAPH=1 (on a GPU: the default up to 1M parameters): from the second
    round at each budget the selection is one recorded graph, replayed. Under the emulator a
    capture records the kernels and refuses any other device work, as a CUDA graph would not
    replay it: the run must still equal the host's, through budget changes (a density
    warm-up)."""
    options = {"policy": policy, "granularity": "layer", "density_warmup": 1.0}
    kw = {"iterations": 30, "batches_per_epoch": 10}
    device = two_workers(tmp_path / "device", monkeypatch, True, graph=True, **options, **kw)
    host = two_workers(tmp_path / "host", monkeypatch, False, **options, **kw)
    budgets = {row["budget"] for row in read_jsonl(tmp_path / "host" / "metrics.jsonl")}
    assert len(budgets) > 1  # the warm-up changed the budget during the run
    for (dev_sum, crossings), (host_sum, _) in zip(device, host):
        assert dev_sum == host_sum
        assert crossings["graph_rounds"] == 30 - len(budgets), crossings  # 1 eager each
        assert crossings["copy_backs"] == 30


def test_a_capture_refuses_array_work_that_allocates():
    """Inside a graph capture only kernel launches (and views) may run: a method that makes
    new memory (.astype, .copy, .sum) or a gather would, under CuPy's relaxed capture, take a
    pool allocation that later work may alias."""
    import numpy as np

    from psparse.backends.cuda import CaptureFailed
    from psparse.backends.emulated import EmulatedBackend
    dev = EmulatedBackend(strict=True)
    a = dev.upload("a", np.arange(8, dtype=np.float32))
    where = dev.upload("where", np.array([1, 2], np.int64))
    for what, work in ((".astype()", lambda: a.astype(np.int64)), (".copy()", a.copy),
                       (".sum()", a.sum), ("indexing with a device array", lambda: a[where])):
        with pytest.raises(CaptureFailed, match=what.replace("(", r"\(").replace(")", r"\)")):
            dev.capture(work)
    graph = dev.capture(lambda: (a.reshape(2, 4), a.view(np.int32), a[2:5]))  # views: fine
    assert graph is not None


def test_the_strict_device_arrays_refuse_every_implicit_way_to_the_host():
    import numpy as np

    from psparse.backends.cuda import HostSync
    from psparse.backends.emulated import EmulatedBackend
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
        # CuPy sizes these from the data, or prints the values: each a read and a wait
        "xp.bincount()": lambda: xp.bincount(a.astype(np.int64)),
        "xp.where() with one argument": lambda: xp.where(a > 3),
        "xp.histogram() without device bin edges": lambda: xp.histogram(a, bins=4),
        "str()": lambda: str(a), "an f-string": lambda: f"{scalar:.3f}",
    }
    for what, attempt in refused.items():
        with pytest.raises(HostSync, match=what.split(" (")[0].replace("(", r"\(").replace(
                ")", r"\)")):
            attempt()
    # what a device allows: arithmetic, reductions to device scalars, gathers, metadata,
    # three-argument where, a histogram over device bin edges, repr (metadata only)
    assert dev.read(xp.where(a > 3, a, 0))[4] == 4.0 and "shape=(10,)" in repr(a)
    assert dev.read(xp.histogram(a, bins=dev.upload("e", np.array([0, 5, 10.0])))[0]).tolist() \
        == [5, 5]
    b = (a * 2 + 1)[dev.upload("i", np.array([1, 9], np.int64))]
    assert b.shape == (2,) and a.size == 10 and len(a) == 10
    assert dev.read(b).tolist() == [3.0, 19.0] and dev.reads == 3  # (with the two above)
    dev.copy_back([(scalar.reshape(1), out := np.zeros(1, np.float32))])
    assert out[0] == 9.0 and dev.copy_backs == 1


def test_a_variable_selection_copies_back_near_its_count_not_its_capacity(tmp_path):
    """threshold's capacity is the whole model (cap=0): its selection is compacted on the
    device and, after a first round that copies it all, copied back up to twice its recent
    counts (at least 1,024 entries), not the 2,410 entries of capacity; a round that selects
    more than expected (here the first, told to expect 1,024 by PSPARSE_COPY_BACK_FIRST) gets
    the rest in a second copy back, and the run still equals the host's to the bit."""
    few = launch(tmp_path / "few", "--policy", "threshold", "--policy-arg", "lam=0.02")
    assert few.returncode == 0, few.stderr
    device = ranks(tmp_path / "few")[0]["device"]
    numel = json.loads((tmp_path / "few" / "summary.json").read_text())["numel"]
    whole_capacity = numel * (4 + 4)  # int32 index + float32 value per entry
    assert device["copy_backs_per_iteration"] == 1.0
    assert device["copy_back_bytes_per_iteration"] < 0.7 * whole_capacity, device
    many = ("--policy", "threshold", "--policy-arg", "lam=0.000001")  # nearly every entry
    host = launch(tmp_path / "host", *many, emulate=None)
    os.environ["PSPARSE_COPY_BACK_FIRST"] = "1024"
    try:
        dev_run = launch(tmp_path / "device", *many)
    finally:
        del os.environ["PSPARSE_COPY_BACK_FIRST"]
    assert host.returncode == 0 and dev_run.returncode == 0, host.stderr + dev_run.stderr
    assert without_timing(read_jsonl(tmp_path / "device" / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "host" / "metrics.jsonl"))
    assert [r["checksum"] for r in ranks(tmp_path / "device")] == \
        [r["checksum"] for r in ranks(tmp_path / "host")]
    iterations = len(read_jsonl(tmp_path / "device" / "metrics.jsonl"))
    assert ranks(tmp_path / "device")[0]["device"]["copy_backs"] == iterations + 1


def test_the_backend_counts_kernel_launches_and_a_graphs_replays():
    import numpy as np

    from psparse.backends.emulated import EmulatedBackend
    dev = EmulatedBackend(strict=True)
    grad = dev.upload("grad", np.zeros(8, np.float32))
    indices = dev.upload("i", np.array([1, 5], np.int64))
    values = dev.upload("v", np.array([2.0, 3.0], np.float32))

    def scatter():
        dev.launch_over("psparse_scatter", 2, (indices, values, np.int64(2), grad))
    scatter()
    graph = dev.capture(lambda: (scatter(), scatter()))
    assert dev.kernel_launches == 1  # a capture records, it does not launch
    graph.launch()
    graph.launch()
    assert dev.kernel_launches == 5 and dev.report(5)["kernel_launches_per_iteration"] == 1.0


def test_the_steady_state_counts_start_after_the_warm_up_rounds():
    """rank-R.json's ``device.steady_state``: per round after the first three (engines built,
    graph captured), what crossed, what was launched and the device arrays allocated (on the
    strict emulator: arrays with memory of their own, as a pool allocation on a GPU)."""
    import numpy as np

    from psparse.backends.cuda import STEADY_AFTER
    from psparse.backends.emulated import EmulatedBackend
    dev = EmulatedBackend(strict=True)
    host = np.zeros(4, np.float32)
    indices = dev.upload("i", np.array([0, 3], np.int64))
    a = dev.xp.zeros(4, dtype=dev.xp.float32)
    for r in range(STEADY_AFTER + 4):
        dev.upload("a", np.arange(4, dtype=np.float32), out=a)  # into its buffer: no allocation
        if r < STEADY_AFTER:  # warm-up work: more launches and a fresh array each round
            dev.xp.zeros(1000, dtype=dev.xp.float32)
            dev.launch_over("psparse_scatter", 2, (indices, a[:2], np.int64(2), a))
        _ = a.reshape(2, 2)  # a view: no allocation
        doubled = a + a  # a new array: one allocation
        dev.launch_over("psparse_scatter", 2, (indices, a[:2], np.int64(2), doubled))
        dev.copy_back([(doubled, host)])
        assert dev.steady_state() is None or r >= STEADY_AFTER
        dev.end_round()
    steady = dev.report(STEADY_AFTER + 4)["steady_state"]
    assert steady["rounds"] == 4
    assert steady["copy_backs_per_iteration"] == 1.0 and steady["uploads_per_iteration"] == 1.0
    assert steady["kernel_launches_per_iteration"] == 1.0
    assert steady["allocations_per_iteration"] == 1.0
    assert steady["copy_back_bytes_per_iteration"] == 16.0
