"""The run directory: one definition of its file names and record schemas.

Written by the server (metrics, evaluations, summary), the workers (rank files, checkpoints),
the launcher (config, logs) or the DDP baseline (the same files); read by ``psparse-launch``'s
progress line, ``psparse-report``, ``psparse-model`` and the experiments. docs/run-directory.md
documents every field.

    RUN_DIR/config.json          the resolved run configuration (RunConfig fields)
    RUN_DIR/metrics.jsonl        one record per iteration (METRICS_FIELDS)
    RUN_DIR/eval.jsonl           one record per evaluation (EVAL_FIELDS)
    RUN_DIR/summary.json         the run's outcome (SUMMARY_FIELDS), written at the end
    RUN_DIR/rank-R.json          worker R's own totals: bytes, time split, final checksum
    RUN_DIR/server.port          the port a local server listens on (for the launcher)
    RUN_DIR/logs/NAME.log        each process's output (launcher)
    RUN_DIR/checkpoint/          --checkpoint-every (psparse/checkpoint.py)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
SUMMARY_FILE = "summary.json"
TIMING_FILE = "timing-rank-0.jsonl"  # --tensorboard: rank 0's time split per iteration
PORT_FILE = "server.port"
LOGS_DIR = "logs"

# Fields of a psparse server's metrics record (the DDP baseline writes iter, workers,
# allreduce_bytes, loss, round_s, time_s instead).
METRICS_FIELDS = ("iter", "workers", "k", "budget", "union", "broadcast_entries",
                  "residual_entries", "dense", "overflow", "proposed", "upload_bytes", "broadcast_bytes",
                  "loss", "round_s", "time_s")
# What a worker's ps.log(...) / evaluation may put into eval.jsonl (finite numbers only), plus
# the iteration it follows and the time since training started.
EVAL_VALUES = ("epoch", "test_loss", "test_acc", "train_loss")
# a report with one of these is an evaluation (a language model has a loss, no accuracy)
EVAL_MEASURES = ("test_loss", "test_acc", "train_loss")
EVAL_FIELDS = ("iter", *EVAL_VALUES, "time_s")
SUMMARY_FIELDS = ("status", "error", "ended", "world_size", "numel", "k", "iterations", "wall_s",
                  "iterations_per_s", "train_s", "train_iterations_per_s", "union_over_k_mean", "union_over_k_max", "pushed_k_mean",
                  "upload_mb", "broadcast_mb", "dense_mb", "allreduce_mb", "final_loss", "test_acc",
                  "test_loss", "rejected_messages", "lost_workers", "evaluators",
                  "server_limit")


def ring_allreduce_bytes(workers: int, numel: int) -> float:
    """Bytes a dense float32 ring allreduce of ``numel`` entries sends per iteration, all
    workers together: each of N sends 2(N-1)/N x numel x 4 B (reduce-scatter, then all-gather),
    the count of the DDP baseline's ``allreduce_bytes``. summary.json's ``allreduce_mb``."""
    return 2 * (workers - 1) * numel * 4


def rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


def read_json(run_dir: Path, name: str) -> dict:
    return json.loads((Path(run_dir) / name).read_text())


class RunDirError(ValueError):
    """A run directory's file cannot be read as psparse wrote it; the text names the file (and
    line) and what is wrong."""


def parse_record(path: Path, n: int, line: bytes) -> dict:
    """Line ``n`` (0-based) of a JSON-lines file as a record, or RunDirError naming both."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{path}, line {n + 1}: not UTF-8 text (byte {exc.start + 1}); the "
                          "file is damaged: restore it, or remove the run directory and start "
                          "again") from None
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}, line {n + 1}: not a JSON record ({exc.msg} at column "
                          f"{exc.colno}); the file is damaged: restore it, or remove the run "
                          "directory and start again") from None
    if not isinstance(record, dict):
        raise RunDirError(f"{path}, line {n + 1}: a JSON record must be an object, got "
                          f"{type(record).__name__}")
    return record


def complete_lines(data: bytes) -> list[bytes]:
    """The whole lines of a JSON-lines file's bytes, split at newlines only (not at the other
    characters str.splitlines takes for line ends): a last line without its newline is one a
    writer was killed in the middle of, and is left out."""
    return data[:data.rfind(b"\n") + 1].split(b"\n")[:-1]


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSON-lines file (a line still being written is left out); a
    damaged line is a RunDirError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    return [parse_record(path, n, line)
            for n, line in enumerate(complete_lines(path.read_bytes())) if line.strip()]


class JsonlTail:
    """Reads the records a JSON-lines file gained since the last call, complete lines only (a
    running server's metrics.jsonl, for the launcher's progress line)."""

    def __init__(self):
        self._offsets: dict[Path, int] = {}

    def new(self, path: Path) -> list[dict]:
        path = Path(path)
        if not path.is_file():
            return []
        with open(path, "rb") as fh:
            fh.seek(self._offsets.get(path, 0))
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines; the writer may be mid-line
        self._offsets[path] = self._offsets.get(path, 0) + end
        return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]


def write_atomic(path: Path, text: str) -> None:
    """Write so that a reader never sees half a file, and a kill at any moment leaves the old
    file or the new one: to a temporary name, flushed to disk, then renamed over the old (the
    name holds the process id: several server shards may write a sharded run's merged files
    at once, the same content)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    """The rename itself on disk (a directory's entries are flushed by fsync on it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a directory: the rename is still atomic
    finally:
        os.close(fd)


def write_json(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def open_truncated(path: Path, keep):
    """Open a JSON-lines file for appending, first dropping the records ``keep(n, record)``
    rejects (a resumed run rewrites what came after its checkpoint). The rewrite is atomic
    (write_atomic): a kill during it leaves the file as it was, never a part of it. A torn
    last line (its writer killed mid-line) is dropped; a damaged whole line is a RunDirError
    naming the file and line."""
    path = Path(path)
    if path.is_file():
        lines = complete_lines(path.read_bytes())
        kept = [line for n, line in enumerate(lines)
                if line.strip() and keep(n, parse_record(path, n, line))]
        write_atomic(path, "".join(line.decode("utf-8") + "\n" for line in kept))
    return open(path, "a")


def board_dir(tensorboard: str, out) -> Path:
    """``--tensorboard DIR``: where a run's TensorBoard event files go, DIR/<the run
    directory's name>/ (one TensorBoard run per psparse run)."""
    return Path(tensorboard) / Path(out).resolve().name


# What marks a folder as a run directory (docs/run-directory.md): any of these
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, EVAL_FILE, SUMMARY_FILE, "checkpoint", "shard-0")


def held_run(out: Path) -> str | None:
    """What of another run ``out`` holds (e.g. "config.json, checkpoint/"), or None: a missing
    or empty folder, or one with none of a run's files, can take a fresh run."""
    found = [name + ("/" if (out / name).is_dir() else "") for name in RUN_MARKERS
             if (out / name).exists()]
    return ", ".join(found) or None


# write_atomic's temporary files (NAME.PID.tmp) that a kill left: of these files' names
_RUN_FILE_STEMS = ("config", "metrics", "eval", "summary", "server", "rank-0", "recall")


def clear_run_dir(out: Path) -> None:
    """--overwrite: the run directory's own files and folders, all of them (whatever else the
    folder holds is left)."""
    for entry in out.iterdir():
        name = entry.name
        ours = name in RUN_MARKERS or name in (PORT_FILE, TIMING_FILE, LOGS_DIR, "probes",
                                               "recall.jsonl", "server_residual.npz") \
            or name.startswith(("rank-", "shard-", "selections-rank-", "timing-rank-")) \
            or (name.endswith(".tmp") and name.split(".")[0] in _RUN_FILE_STEMS)
        if ours:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def complete_run(out: Path) -> str | None:
    """For --resume: how ``out``'s run ended, when it ended well (its summary.json says ok
    and metrics.jsonl holds a record of every iteration it counts), e.g. "ok: 300 iterations,
    iterations reached"; None when there is something to resume."""
    try:
        summary = json.loads((out / SUMMARY_FILE).read_text())
        recorded = len(read_jsonl(out / METRICS_FILE))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") != "ok" or \
            recorded < (summary.get("iterations") or 0):
        return None
    return f"ok: {summary.get('iterations')} iterations, {summary.get('ended') or 'ended'}"
