"""How close a round comes to the global top-k: the recall probe (``--probe-recall EVERY``).

The selection every rule approximates is the top-k of the *sum* of all workers' accumulators,
S = sum_i a_i: what one worker holding every gradient would send. No worker sees S in a normal
run, so the probe gathers it on a sample of iterations (every EVERY-th) through the run
directory, which the processes of a local run share: before its push, every worker writes its
accumulator (the entries its policy selects from, this round's gradient included) to
``RUN_DIR/probes/``; the round's aggregate reaches a worker only after every live worker has
pushed, so when it does, the lowest live rank finds every file there, sums them and appends a
row to ``RUN_DIR/recall.jsonl``, then deletes them (a few files at a time on disk). Normal runs
write nothing and send nothing extra; the probe adds no traffic to the wire, so the metrics'
byte counts are those of the run without it.

A row: ``iter``; ``k`` (the round's budget) and ``union`` (the aggregate's entries);
``recall``, the share of S's top-k (by |S|, ties to the lower index) that the union holds;
``energy``, the share of S's squared norm at the union's indices; ``energy_topk``, that share
at S's own top-k (the most any k entries carry: the ceiling ``energy`` is read against, as
``recall`` is read against 1); and ``workers``, how many accumulators were summed.

Needs a run directory every worker writes to (local runs; ``--hostfile``/``--slurm`` only with
a shared file system) and the host path in one round per iteration (not ``--device cuda``,
``--bucket-mb``/``--overlap``): the session refuses the rest. A resumed run drops the rows at
and after the iteration it resumes from, so the file has one row per probed iteration.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ..rundir import open_truncated

RECALL_FILE = "recall.jsonl"
PROBE_DIR = "probes"
WAIT_S = 30.0  # a live worker's file that has not appeared by then: the row is skipped


def measures(total: np.ndarray, union: np.ndarray, k: int) -> dict:
    """recall, energy and energy_topk of a union against the sum of accumulators ``total``
    (the numpy definition the tests check by hand)."""
    magnitude = np.abs(total.astype(np.float64))
    energy = magnitude ** 2
    norm = float(energy.sum())
    k = min(k, total.size)
    # S's top-k, ties to the lower index: a stable sort of -|S|
    top = np.argsort(-magnitude, kind="stable")[:k]
    hits = np.isin(top, union, assume_unique=True).sum() if k else 0
    return {"recall": float(hits / k) if k else 1.0,
            "energy": float(energy[union].sum() / norm) if norm > 0 else 1.0,
            "energy_topk": float(energy[top].sum() / norm) if norm > 0 else 1.0}


def truncate(path: Path, start: int) -> None:
    """Keep the rows of iterations before ``start`` (a resumed run writes the rest again)."""
    if Path(path).is_file():
        open_truncated(path, lambda n, row: row["iter"] < start).close()


class RecallProbe:
    """A worker's part of the probe: ``save`` before its push, ``reduce`` after the aggregate."""

    def __init__(self, out_dir: Path, rank: int, every: int, start: int = 0, *,
                 live=lambda: [0], say=print):
        """``live()``: the ranks in the run now (an elastic run loses some); the lowest one
        sums."""
        self.out_dir, self.rank, self.every, self.say = Path(out_dir), rank, every, say
        self.live = live
        self.dir = self.out_dir / PROBE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"*-rank{rank}.npy"):  # a stopped attempt's
            stale.unlink(missing_ok=True)
        if rank == min(live()):
            truncate(self.out_dir / RECALL_FILE, start)

    def due(self, it: int) -> bool:
        return it % self.every == 0

    def _file(self, it: int, rank: int) -> Path:
        return self.dir / f"t{it:08d}-rank{rank}.npy"

    def save(self, it: int, accumulator: np.ndarray) -> None:
        """This worker's accumulator before its push (written whole, then renamed, so a reader
        never sees part of one)."""
        tmp = self.dir / f".t{it:08d}-rank{self.rank}.tmp.npy"
        np.save(tmp, np.asarray(accumulator, dtype=np.float32))
        os.replace(tmp, self._file(it, self.rank))

    def discard(self, it: int) -> None:
        """A round that was skipped (a GradScaler overflow somewhere): no row, no files left."""
        if self.rank == min(self.live()):
            for f in self.dir.glob(f"t{it:08d}-rank*.npy"):
                f.unlink(missing_ok=True)

    def reduce(self, it: int, union: np.ndarray, k: int) -> dict | None:
        """The lowest live rank: sum the live workers' files of iteration ``it``, append the
        row, delete the files. The others return None at once."""
        live = self.live()
        if self.rank != min(live):
            return None
        files = [self._file(it, r) for r in live]
        deadline = time.monotonic() + WAIT_S
        while not all(f.is_file() for f in files):
            if time.monotonic() > deadline:
                missing = [r for r, f in zip(live, files) if not f.is_file()]
                self.say(f"recall probe: no accumulator of rank(s) {missing} for iteration "
                         f"{it} after {WAIT_S:.0f} s (is the run directory shared?); row skipped")
                return None
            time.sleep(0.005)
        total = None
        for f in files:  # in rank order: the same sum on every run
            part = np.load(f)
            total = part.astype(np.float64) if total is None else total + part
        self.discard(it)  # and a lost rank's file of this round, if it wrote one
        row = {"iter": it, "k": int(k), "union": int(union.size),
               **measures(total, np.asarray(union, dtype=np.int64), k), "workers": len(live)}
        with open(self.out_dir / RECALL_FILE, "a") as out:
            out.write(json.dumps(row) + "\n")
        return row


def summarise(rows: list[dict]) -> dict:
    """Means over a run's probed rounds (what psparse-report and the sweeps show)."""
    if not rows:
        return {}
    return {f"{key}_mean": float(np.mean([r[key] for r in rows]))
            for key in ("recall", "energy", "energy_topk")} | {"probes": len(rows)}
