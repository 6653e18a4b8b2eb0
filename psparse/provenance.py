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
import subprocess
from pathlib import Path

from . import __version__

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
