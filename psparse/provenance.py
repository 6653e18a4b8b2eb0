"""Which code made a run: git commit, dirty flag and psparse version, recorded in config.json.

``psparse-launch`` writes them under ``provenance`` in RUN_DIR/config.json. ``make exp-*``
(experiments/run.py) and ``make exp-cluster`` reuse a finished run only when its ``code_id``
equals the current one (``--reuse-any`` overrides); the scaling sweeps and
benchmarks/bench_scale.py reuse any finished run of the same configuration and name the code
of their tables from these fields (experiments/harness.py). A dirty tree's id includes a digest of ``git diff HEAD`` over psparse/, so two runs
with the same uncommitted changes still match and runs with different ones do not.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

__version__ = "0.2.0"  # psparse.__version__ (setup.cfg states it too; a test keeps them equal)
SOURCE = Path(__file__).resolve().parent.parent  # the checkout psparse is imported from


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(SOURCE), *args], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def provenance() -> dict:
    """{"git_commit", "git_dirty", "code_id", "psparse_version"}; commit None outside git."""
    commit = _git("rev-parse", "HEAD")
    commit = commit.strip() if commit else None
    diff = _git("diff", "HEAD", "--", "psparse") if commit else None
    dirty = bool(diff)
    code_id = commit
    if commit and dirty:
        code_id = f"{commit}+dirty-{hashlib.sha256(diff.encode()).hexdigest()[:12]}"
    return {"git_commit": commit, "git_dirty": dirty, "code_id": code_id,
            "psparse_version": __version__}


_KERNEL_PROBE = """
import torch
with torch.autocast("cpu", dtype=torch.bfloat16):
    torch.nn.functional.conv2d(torch.randn(1, 1, 8, 8), torch.randn(2, 1, 3, 3))
print("capability", torch.backends.cpu.get_cpu_capability())
"""


def float_kernels(env: dict | None = None) -> dict:
    """Which float kernels torch takes on this CPU under ``env`` (default: this process's):
    {"onednn_max_cpu_isa", "torch_capability", "onednn_isa"}, read from a bf16 convolution in
    a child process with oneDNN's verbose line on.

    Why it matters: bf16/fp16 autocast (and some fp32 convolutions) take other oneDNN kernels
    on CPUs with AMX or AVX512-BF16 than on older ones, so training's floats, and whatever is
    decided from them (an accuracy, an early stop), differ between such machines; a run is
    bit-reproducible on the same machine and kernel set (docs/api.md, "Determinism").
    ``ONEDNN_MAX_CPU_ISA`` caps the set (AVX2, AVX512_CORE, ...); below AVX512_CORE no oneDNN
    primitive serves bf16 and torch uses its own kernels (``onednn_isa`` says so)."""
    import sys
    env = dict(os.environ if env is None else env)
    r = subprocess.run([sys.executable, "-c", _KERNEL_PROBE], capture_output=True, text=True,
                       env={**env, "ONEDNN_VERBOSE": "1"}, timeout=120)
    lines = r.stdout.splitlines()
    onednn = next((ln.split("isa:", 1)[1] for ln in lines if "info,cpu,isa:" in ln),
                  "none: no oneDNN primitive ran, torch's own kernels")
    capability = next((ln.split()[1] for ln in lines if ln.startswith("capability ")),
                      f"unknown (probe failed: {r.stderr.strip()[-200:]})")
    return {"onednn_max_cpu_isa": env.get("ONEDNN_MAX_CPU_ISA", "unset"),
            "torch_capability": capability, "onednn_isa": onednn}
