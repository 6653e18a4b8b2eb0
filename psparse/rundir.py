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


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSON-lines file (a line still being written is left out)."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


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
    """Write so that a reader never sees half a file: to a temporary name, then rename (the
    name holds the process id: several server shards may write a sharded run's merged files
    at once, the same content)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def open_truncated(path: Path, keep):
    """Open a JSON-lines file for appending, first dropping the records ``keep(n, record)``
    rejects (a resumed run rewrites what came after its checkpoint)."""
    path = Path(path)
    kept = []
    if path.is_file():
        for n, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                record = json.loads(line)
                if keep(n, record):
                    kept.append(line)
    fh = open(path, "w")
    for line in kept:
        fh.write(line + "\n")
    fh.flush()
    return fh


def board_dir(tensorboard: str, out) -> Path:
    """``--tensorboard DIR``: where a run's TensorBoard event files go, DIR/<the run
    directory's name>/ (one TensorBoard run per psparse run)."""
    return Path(tensorboard) / Path(out).resolve().name
