"""A worker's memory in units of the model's bytes (issue 38, lever 4).

    .venv/bin/python benchmarks/bench_memory.py       # 25M parameters (about 2 min a policy)
    .venv/bin/python benchmarks/bench_memory.py --numel-m 5 --policies topk

A real run per policy: one ``psparse-server`` and 2 ``psparse-worker`` processes on loopback,
a deep MLP on scikit-learn's digits (64 -> 1024, L layers 1024 x 1024, -> 10; L for the size
asked), SGD with momentum, density 1%, 30 iterations. Each worker's peak resident memory is its own
``ru_maxrss`` (``os.wait4``), so nothing polls it. The process baseline -- the interpreter,
torch, psparse, the numba kernels, ZeroMQ and the data -- is the peak of the same run with a
model of ~10k parameters, and is subtracted; what is left is divided by 4 bytes x numel.

The floor of any error-feedback worker is 4x the model: parameters, gradients, the optimizer's
momentum and the accumulator. A plain torch loop of the same model (no psparse: forward,
backward, SGD step with momentum, in one process) is measured the same way for scale: its
floor is 3x plus what backward holds while it runs (a layer's fresh gradient before it is
added into ``.grad``). Writes ``worker_memory`` to benchmarks/results/bench.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

WORKERS = 2
ITERATIONS = 30
BASELINE = (64, 1)  # width, depth: 64*64 + 64*64 + 64*10 + biases, ~9k parameters


def deep_mlp(in_shape, num_classes, width="1024", depth="24"):
    """The benchmark's model (``--model benchmarks.bench_memory:deep_mlp``): inputs -> width,
    ``depth`` hidden layers width x width, -> classes. At 25M parameters (24 layers of 1024)
    its largest layer is 4% of the model, as in the networks of that size users train
    (ResNet-50: 9%), so backward's fresh gradient of one layer is small beside the model."""
    import math

    import torch.nn as nn

    w, layers = int(width), [nn.Flatten(), nn.Linear(math.prod(in_shape), int(width)), nn.ReLU()]
    for _ in range(int(depth)):
        layers += [nn.Linear(w, w), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(w, num_classes))


def numel_of(width: int, depth: int, inputs: int = 64, classes: int = 10) -> int:
    return inputs * width + width + depth * (width * width + width) + width * classes + classes


def depth_for(numel: int, width: int = 1024) -> int:
    """The fewest hidden layers of ``width`` whose model has at least ``numel`` parameters."""
    depth = 0
    while numel_of(width, depth) < numel:
        depth += 1
    return depth


def training_args(width: int, depth: int, policy: list[str]) -> list[str]:
    return ["--workers", str(WORKERS), "--model", "benchmarks.bench_memory:deep_mlp",
            "--model-arg", f"width={width}", "--model-arg", f"depth={depth}", "--dataset", "digits", "--density", "0.01",
            "--iterations", str(ITERATIONS), "--eval-every", "0", "--threads", "1",
            "--lr", "0.01", *policy]


def worker_peaks(shape: tuple[int, int], policy: list[str]) -> list[int]:
    """Peak resident bytes of each worker of one real run (server and workers on loopback)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="psparse-mem-") as out:
        server = subprocess.Popen([sys.executable, "-m", "psparse.server.cli", "--port", "0",
                                   "--out", out, "--workers", str(WORKERS)],
                                  cwd=ROOT, env=env)
        port_file = Path(out) / "server.port"
        deadline = time.monotonic() + 120
        while not port_file.is_file() or not port_file.read_text().strip():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"psparse-server did not start (exit {server.poll()})")
            time.sleep(0.05)
        port = port_file.read_text().strip()
        workers = [subprocess.Popen([sys.executable, "-m", "psparse.training.loop", "--rank",
                                     str(r), "--connect", f"127.0.0.1:{port}", "--out", out,
                                     *training_args(*shape, policy)], cwd=ROOT, env=env)
                   for r in range(WORKERS)]
        peaks = []
        for w in workers:
            _, status, usage = os.wait4(w.pid, 0)
            w.returncode = os.waitstatus_to_exitcode(status)
            if w.returncode != 0:
                server.kill()
                raise SystemExit(f"a worker failed (exit {w.returncode}) with {policy}")
            peaks.append(usage.ru_maxrss * 1024)  # Linux: kilobytes
        server.wait(timeout=60)
    return peaks


PLAIN_TORCH = r"""
import os, resource, sys, torch
sys.path.insert(0, os.environ["PSPARSE_ROOT"])
from benchmarks.bench_memory import deep_mlp
torch.manual_seed(0)
torch.set_num_threads(1)
model = deep_mlp((8, 8), 10, sys.argv[1], sys.argv[2])
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
for _ in range(int(sys.argv[3])):
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def plain_torch_peak(shape: tuple[int, int]) -> int:
    env = {**os.environ, "PSPARSE_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    # import psparse too, so the baseline's libraries are the same as a worker's
    code = "import psparse.worker, psparse.policies\n" + PLAIN_TORCH
    out = subprocess.run([sys.executable, "-c", code, *map(str, shape), str(ITERATIONS)], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


POLICIES = {"topk": ["--policy", "topk"],
            "vote": ["--policy", "vote", "--policy-arg", "keep=1.5"],
            "threshold": ["--policy", "threshold"],
            "cltk": ["--policy", "cltk"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel-m", type=float, default=25.0,
                   help="model size in millions of parameters (default 25)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, of {', '.join(POLICIES)} (default all)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="run every process with glibc's MALLOC_MMAP_THRESHOLD_=BYTES: a fixed "
                        "threshold, so freed large temporaries go back to the system instead "
                        "of staying in the heap (glibc raises its threshold as it frees); "
                        "recorded as worker_memory_mmap<BYTES>")
    p.add_argument("--no-record", action="store_true", help="do not write bench.json")
    args = p.parse_args(argv)
    if args.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    shape = (1024, depth_for(int(args.numel_m * 1e6)))
    numel = numel_of(*shape)
    model_bytes = 4 * numel
    print(f"deep MLP 64 -> 1024, {shape[1]} x (1024 x 1024), -> 10: {numel:,} parameters, "
          f"{model_bytes / 2**20:.0f} MiB; baseline model {numel_of(*BASELINE):,}", flush=True)
    rows, figures = [], {"numel": numel, "model_mib": model_bytes / 2**20}
    base_torch = plain_torch_peak(BASELINE)
    torch_x = (plain_torch_peak(shape) - base_torch) / model_bytes
    rows.append(["plain torch (params, grads, momentum)", "-", f"{torch_x:.2f}", "3 + backward's"])
    figures["plain_torch_x"] = torch_x
    for name in args.policies.split(","):
        base = max(worker_peaks(BASELINE, POLICIES[name]))
        peaks = worker_peaks(shape, POLICIES[name])
        over = [(peak - base) / model_bytes for peak in peaks]
        rows.append([f"psparse worker, {name}", f"{base / 2**20:.0f}", f"{max(over):.2f}",
                     "4 + backward's"])
        figures[f"{name}_x"] = max(over)
        print(f"{name}: peaks {[round(x / 2**20) for x in peaks]} MiB, baseline "
              f"{base / 2**20:.0f} MiB: {max(over):.2f}x the model", flush=True)
    print(table(rows, ["process", "baseline MiB", "peak - baseline, x model bytes",
                       "floor, x model bytes"]))
    if not args.no_record:
        key = "worker_memory" + (f"_mmap{args.mmap_threshold}" if args.mmap_threshold else "")
        record({key: figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
