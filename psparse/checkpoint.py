"""Checkpoints: atomic per-process files, and finding the newest iteration all processes saved.

Every ``--checkpoint-every`` iterations, at the same iteration boundary, the server and every
worker write RUN_DIR/checkpoint/<who>-<iteration>.pt (written to a temporary name, then renamed,
so a file is whole or absent). A run stopped at any moment resumes from the newest iteration for
which the server and all workers have a file; older files are pruned to the last two. With
key-range server shards (``--servers S``) each shard keeps its own files in
RUN_DIR/shard-I/checkpoint/, and a resume needs all S of them.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

KEEP = 2  # checkpoints per process: the newest may be incomplete across processes


def directory(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoint"


def save(run_dir: Path, who: str, iteration: int, state: dict) -> Path:
    folder = directory(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{who}-{iteration}.pt"
    tmp = folder / f".{who}-{iteration}.pt.tmp"
    with open(tmp, "wb") as fh:  # pickle: numpy arrays and torch tensors alike, no torch here
        pickle.dump(state, fh, protocol=5)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in sorted(iterations(run_dir, who))[:-KEEP]:
        (folder / f"{who}-{old}.pt").unlink(missing_ok=True)
    return path


def load(run_dir: Path, who: str, iteration: int) -> dict:
    with open(directory(run_dir) / f"{who}-{iteration}.pt", "rb") as fh:
        return pickle.load(fh)  # our own files only: never point --resume at untrusted ones


def iterations(run_dir: Path, who: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(who)}-(\d+)\.pt$")
    folder = directory(run_dir)
    if not folder.is_dir():
        return []
    return [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]


def latest_common(run_dir: Path, world_size: int, shards: int = 1) -> int | None:
    """Newest iteration saved by the server (every one of ``shards`` key-range servers, whose
    files are in RUN_DIR/shard-I/checkpoint/) and by every worker rank, or None."""
    if shards > 1:
        common = set(iterations(Path(run_dir) / "shard-0", "server"))
        for index in range(1, shards):
            common &= set(iterations(Path(run_dir) / f"shard-{index}", "server"))
    else:
        common = set(iterations(run_dir, "server"))
    for rank in range(world_size):
        common &= set(iterations(run_dir, f"rank-{rank}"))
    return max(common) if common else None
