"""``--tensorboard DIR``: a run's records as TensorBoard scalars, written by the launcher.

One TensorBoard run per psparse run, ``DIR/<the run directory's name>/``: the launcher's
progress reader hands this writer every per-iteration record (a sharded run's merged by the
servers' rule), every evaluation, and every row of rank 0's time split (RUN_DIR/
timing-rank-0.jsonl, ``psparse/worker/board.py``) as it reads them: one writer, one event file
per attempt. A restarted
attempt writes a new event file with ``purge_step`` at its resume point: what the failed
attempt wrote from there on is dropped by TensorBoard, and ``run/restarts`` counts the restarts
at that step. The tags are docs/run-directory.md's ("TensorBoard").
"""

from __future__ import annotations

from pathlib import Path

from ..rundir import EVAL_VALUES, board_dir


def summary_writer(log_dir: Path, purge_step: int | None = None):
    """torch's SummaryWriter at ``log_dir``, or an error naming the missing package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError(f"--tensorboard needs the tensorboard package ({exc}): pip install "
                           "'psparse[tensorboard]' (or pip install tensorboard)") from None
    return SummaryWriter(str(log_dir), purge_step=purge_step)


class RunBoard:
    """The launcher's writer for one attempt of a run (``start``: its first iteration)."""

    def __init__(self, tensorboard: str, out: Path, start: int = 0, attempt: int = 0):
        self.start = start
        self.writer = summary_writer(board_dir(tensorboard, out), purge_step=start or None)
        if attempt:
            self.writer.add_scalar("run/restarts", attempt, start)

    def record(self, rec: dict) -> None:
        """One iteration's record from metrics.jsonl."""
        step = rec["iter"]
        if step < self.start:  # an earlier attempt's, already on the board
            return
        add = self.writer.add_scalar
        if rec.get("loss") is not None:
            add("train/loss", rec["loss"], step)
        if "allreduce_bytes" in rec:  # a DDP baseline's ring
            add("send_kb/allreduce", rec["allreduce_bytes"] / 1e3, step)
            return
        add("round/union_over_k", rec["union"] / max(1, rec.get("budget") or 1), step)
        add("send_kb/pushed", rec["upload_bytes"] / 1e3, step)
        add("send_kb/broadcast", rec["broadcast_bytes"] / 1e3, step)
        add("round/overflow", int(bool(rec.get("overflow"))), step)

    def timing(self, rec: dict) -> None:
        """One row of rank 0's time split (RUN_DIR/timing-rank-0.jsonl)."""
        if rec["iter"] >= self.start:
            for name in ("compute", "select", "wait"):
                self.writer.add_scalar(f"time_ms/{name}", rec[f"{name}_ms"], rec["iter"])

    def evaluation(self, rec: dict) -> None:
        """One evaluation from eval.jsonl (the evaluator's test accuracy and loss, ...)."""
        for key in EVAL_VALUES:
            if key != "epoch" and rec.get(key) is not None and rec["iter"] >= self.start:
                self.writer.add_scalar(f"eval/{key}", rec[key], rec["iter"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
