"""Checkpoints: atomic per-process files, and finding the newest iteration all processes saved.

Every ``--checkpoint-every`` iterations, at the same iteration boundary, the server and every
worker write RUN_DIR/checkpoint/<who>-<iteration>.pt (written to a temporary name, then renamed,
so a file is whole or absent). A run stopped at any moment resumes from the newest iteration for
which the server and every worker live at that iteration have a file (``resume_point``); older
files are pruned to the last two. With key-range server shards (``--servers S``) each shard
keeps its own files in RUN_DIR/shard-I/checkpoint/, and a resume needs all S of them.

The server's file begins with a small header, ``{"live": [ranks]}``: the workers still in the
run at that iteration (fewer than all once an ``--elastic`` run lost some), so that finding the
resume point reads a few bytes per checkpoint, not the server's whole state. A worker lost
before an iteration saves nothing at it, and is not asked for: the run resumes with the ranks
that were live then (docs/cli.md, "Restarts").
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
from pathlib import Path
from typing import NamedTuple

KEEP = 2  # checkpoints per process: the newest may be incomplete across processes
HEADER = "psparse_checkpoint_header"  # the first pickle of a file with a header holds this key


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read back; the text names the file and the problem."""


class ResumePoint(NamedTuple):
    iteration: int
    live: list[int]  # the worker ranks in the run at that iteration (all, unless elastic lost some)


def directory(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoint"


def save(run_dir: Path, who: str, iteration: int, state: dict,
         header: dict | None = None) -> Path:
    """``state`` as RUN_DIR/checkpoint/<who>-<iteration>.pt, preceded by ``header`` when given
    (read alone by ``header``)."""
    folder = directory(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{who}-{iteration}.pt"
    tmp = folder / f".{who}-{iteration}.pt.tmp"
    with open(tmp, "wb") as fh:  # pickle: numpy arrays and torch tensors alike, no torch here
        if header is not None:
            pickle.dump({HEADER: header}, fh, protocol=5)
        pickle.dump(state, fh, protocol=5)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in sorted(iterations(run_dir, who))[:-KEEP]:
        (folder / f"{who}-{old}.pt").unlink(missing_ok=True)
    return path


def load(run_dir: Path, who: str, iteration: int) -> dict:
    """The state saved by ``save``; CheckpointError naming the file when it is damaged."""
    path = directory(run_dir) / f"{who}-{iteration}.pt"
    with _reading(path) as fh:
        first = pickle.load(fh)  # our own files only: never point --resume at untrusted ones
        state = pickle.load(fh) if isinstance(first, dict) and HEADER in first else first
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is damaged: it holds a "
                              f"{type(state).__name__}, not a saved state")
    return state


def header(run_dir: Path, who: str, iteration: int) -> dict:
    """A checkpoint's header without its state ({} for a file saved without one);
    CheckpointError naming the file when it cannot be read."""
    path = directory(run_dir) / f"{who}-{iteration}.pt"
    with _reading(path) as fh:
        first = pickle.load(fh)
    return first[HEADER] if isinstance(first, dict) and HEADER in first else {}


class _reading:
    """Open a checkpoint for reading; whatever fails while it is read (a file cut short,
    garbage, gone) becomes a CheckpointError that names it."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.fh = open(self.path, "rb")
        except OSError as exc:
            raise CheckpointError(f"checkpoint {self.path} cannot be read: {exc.strerror}") \
                from None
        return self.fh

    def __exit__(self, kind, exc, tb):
        self.fh.close()
        if exc is not None and not isinstance(exc, CheckpointError) and \
                isinstance(exc, Exception):
            size = self.path.stat().st_size if self.path.exists() else 0
            raise CheckpointError(f"checkpoint {self.path} is damaged ({size} bytes): "
                                  f"{type(exc).__name__}: {exc}; delete it to resume from "
                                  "the one before (or start the run again)") from None
        return False


def iterations(run_dir: Path, who: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(who)}-(\d+)\.pt$")
    folder = directory(run_dir)
    if not folder.is_dir():
        return []
    return [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]


def resume_point(run_dir: Path, world_size: int, shards: int = 1) -> ResumePoint | None:
    """The newest iteration that the server (every one of ``shards`` key-range servers, whose
    files are in RUN_DIR/shard-I/checkpoint/) saved and every worker rank live at it saved
    (the server's header names them: fewer than ``world_size`` after an elastic loss), with
    those ranks; None when there is no such iteration."""
    run_dir = Path(run_dir)
    server_dirs = [run_dir / f"shard-{i}" for i in range(shards)] if shards > 1 else [run_dir]
    common = set(iterations(server_dirs[0], "server"))
    for d in server_dirs[1:]:
        common &= set(iterations(d, "server"))
    saved = {r: set(iterations(run_dir, f"rank-{r}")) for r in range(world_size)}
    for it in sorted(common, reverse=True):
        every = list(range(world_size))  # (a rank any shard had lost by then is lost)
        live = sorted(set.intersection(*(set(header(d, "server", it).get("live", every))
                                         for d in server_dirs)))
        if all(it in saved[r] for r in live):
            return ResumePoint(it, sorted(live))
    return None


def damaged(run_dir: Path, world_size: int, shards: int = 1) -> list[str]:
    """What is wrong with the files of the resume point (a server file whose header cannot
    be read, a file cut short or unreadable): empty when every file of it is whole
    (check_whole). The launcher checks before it resumes or restarts, so that a damaged file
    is named, not restarted on."""
    try:
        point = resume_point(run_dir, world_size, shards)
    except CheckpointError as exc:
        return [str(exc)]
    if point is None:
        return []
    run_dir = Path(run_dir)
    server_dirs = [run_dir / f"shard-{i}" for i in range(shards)] if shards > 1 else [run_dir]
    problems = []
    for folder, who in [(d, "server") for d in server_dirs] + \
            [(run_dir, f"rank-{r}") for r in point.live]:
        try:
            check_whole(folder, who, point.iteration)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def check_whole(run_dir: Path, who: str, iteration: int) -> None:
    """CheckpointError unless the file holds whole pickles (its header's, then its state's)
    and nothing after them. Walks the pickle opcodes without running them: no object is
    rebuilt (a worker's CUDA tensors would start CUDA in the launcher, or fail on a host
    without a GPU), and a file cut short, or garbage, fails where it stops making sense."""
    path = directory(run_dir) / f"{who}-{iteration}.pt"
    with _reading(path) as fh:
        for _ in pickletools.genops(fh):  # the first pickle: the header, or the whole state
            pass
        if fh.read(1):  # a header was first: the state follows, then the end of the file
            fh.seek(-1, os.SEEK_CUR)
            for _ in pickletools.genops(fh):
                pass
            if fh.read(1):
                raise ValueError("bytes after the saved state")
