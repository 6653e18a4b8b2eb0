"""``--tensorboard``: rank 0's time split per iteration, for the run's TensorBoard board.

The launcher writes a run's scalars (``psparse/launch/tensorboard.py``) from the records the
servers write; what only a worker knows per iteration is its own time, so rank 0 records it
in RUN_DIR/timing-rank-0.jsonl, one line per iteration: ``compute_ms`` (between two rounds:
data, forward, backward, the optimizer), ``select_ms`` (error feedback, selection, any
proposal round) and ``wait_ms`` (from the push to the aggregate), the deltas of its
``RoundClock``. The launcher reads the file as it grows and writes ``time_ms/*`` with the rest,
so one event file per attempt holds the whole run (on a cluster without a shared run
directory rank 0's file stays on its host, and the board has no times).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..rundir import TIMING_FILE


class TimingLog:
    """Rank 0's per-iteration time split, appended to the run directory's file (which the
    launcher keeps up to a resumed attempt's start, before the attempt's processes run)."""

    def __init__(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / TIMING_FILE, "a")
        self.last: dict[str, float] | None = None

    def add(self, it: int, times: dict[str, float]) -> None:
        """Iteration ``it`` is done; ``times``: the clock's running totals (seconds)."""
        if self.last is not None:
            row = {"iter": it, **{f"{name[:-2]}_ms": round(1e3 * (times[name] -
                                                                   self.last[name]), 4)
                                  for name in ("compute_s", "select_s", "wait_s")}}
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        self.last = dict(times)

    def close(self) -> None:
        self.file.close()
