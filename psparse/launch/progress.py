"""The launcher's view of a running run: the progress line and the summary table.

The launcher's view of a running run: a progress line from the records the servers write
(a sharded run's by the servers' own merge rule, psparse/server/records.py), and the summary
table at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..rundir import EVAL_FILE, METRICS_FILE, SUMMARY_FILE, TIMING_FILE, JsonlTail
from ..server.records import merge_records
from ..wire import keyranges


class Progress:
    def __init__(self, out: Path, shards: int, baseline: str | None, quiet: bool, board=None):
        self.out, self.shards, self.baseline, self.quiet = out, shards, baseline, quiet
        self.board = board  # --tensorboard: a RunBoard fed every record read, or None
        self._tail = JsonlTail()  # the new records of the run's files
        self._pending: dict[int, list] = {}  # iteration -> its shards' records so far
        self._last = {"metrics": None, "eval": None}
        self._bytes = [0, 0]
        self._unions: list[float] = []

    @property
    def latest(self) -> dict | None:
        """The newest per-iteration record read."""
        return self._last["metrics"]

    def _metrics_records(self) -> list[dict]:
        """New per-iteration records: the run's, or for S shards each iteration's merged record
        once every shard has written its own."""
        if self.shards == 1 or self.baseline:
            return self._tail.new(self.out / METRICS_FILE)
        for index in range(self.shards):
            for rec in self._tail.new(keyranges.shard_dir(self.out, index) / METRICS_FILE):
                self._pending.setdefault(rec["iter"], []).append(rec)
        done = sorted(it for it, recs in self._pending.items() if len(recs) == self.shards)
        return [merge_records(self._pending.pop(it)) for it in done]  # the server's rule

    def read(self) -> None:
        for rec in self._metrics_records():
            self._last["metrics"] = rec
            if self.board is not None:
                self.board.record(rec)
            if "allreduce_bytes" in rec:  # the DDP baseline: a ring moves half each way
                self._bytes[0] += rec["allreduce_bytes"] / 2
                self._bytes[1] += rec["allreduce_bytes"] / 2
                continue
            self._bytes[0] += rec["upload_bytes"]
            self._bytes[1] += rec["broadcast_bytes"]
            self._unions.append(rec["union"] / max(1, rec["budget"]))
        first = self.out if self.shards == 1 else keyranges.shard_dir(self.out, 0)
        for rec in self._tail.new(first / EVAL_FILE):
            self._last["eval"] = rec
            if self.board is not None:
                self.board.evaluation(rec)
        if self.board is not None:  # --tensorboard: rank 0's time split
            for rec in self._tail.new(self.out / TIMING_FILE):
                self.board.timing(rec)

    def line(self, final: bool = False) -> None:
        m, e = self._last["metrics"], self._last["eval"]
        if m is None or self.quiet:
            return
        it = m["iter"] + 1
        rate = it / m["time_s"] if m["time_s"] > 0 else 0.0
        loss = f"{m['loss']:.4f}" if m.get("loss") is not None else "-"
        union = f"{self._unions[-1]:.2f}" if self._unions else "-"
        line = (f"iter {it:>6} | loss {loss} | {evaluation(e)} | union/k "
                f"{union} | up {self._bytes[0] / 1e6:.2f} MB | down "
                f"{self._bytes[1] / 1e6:.2f} MB | {rate:.1f} it/s")
        tty = sys.stdout.isatty()
        print(("\r" + line) if tty else line, end="\n" if final or not tty else "", flush=True)

    def summary(self) -> None:
        """The summary table, from summary.json."""
        path = self.out / SUMMARY_FILE
        if not path.is_file() or self.quiet:
            return
        s = json.loads(path.read_text())
        total = s["upload_mb"] + s["broadcast_mb"]
        rows = [
            ("iterations", f"{s['iterations']}  "
                           f"({s.get('train_iterations_per_s') or s['iterations_per_s']} it/s "
                           f"in training; {s['wall_s']:.1f} s in all)"),
            *([(LONG[field], text) for field, text in evaluated(s)]
              or [("test accuracy", "-")]),
            ("union/k", f"mean {s['union_over_k_mean']}  max {s['union_over_k_max']}  "
                        f"(k = {s['k']}, numel = {s['numel']})" if not s.get("baseline")
             else f"- ({s['baseline']}: dense ring allreduce)"),
        ]
        if s.get("pushed_k_mean") is not None:
            rows.append(("pushed k", f"mean {s['pushed_k_mean']}  (entries per worker per "
                                     f"iteration; the budget is k)"))
        if s.get("baseline"):
            rows.append(("ring allreduce", f"{total:.2f} MB  (all workers, both directions)"))
        else:
            rows += [
                ("upload (all workers)", f"{s['upload_mb']:.2f} MB"),
                ("broadcast (server)", f"{s['broadcast_mb']:.2f} MB"),
                ("dense ring allreduce", f"{s['allreduce_mb']:.2f} MB  (what DDP would move; "
                                         f"psparse moved {share(total, s['allreduce_mb'])})"),
            ]
        for shard in s.get("shards", []):  # --servers S: each key range's share of the bytes
            lo, hi = shard["key_range"]
            rows.append((f"server shard {shard['shard']}",
                         f"keys [{lo}, {hi}): up {shard['upload_mb']:.2f} MB, broadcast "
                         f"{shard['broadcast_mb']:.2f} MB"))
        width = max(len(r[0]) for r in rows)
        print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows))
        print(f"\nfiles: {self.out}/{{config.json, metrics.jsonl, eval.jsonl, summary.json, "
              "logs/" + (", shard-I/" if s.get("shards") else "") + "}")


SHORT = {"test_acc": "test acc", "test_loss": "test loss", "train_loss": "train loss"}
LONG = {**SHORT, "test_acc": "test accuracy"}


def evaluation(record: dict | None) -> str:
    """The progress line's evaluation: the accuracy, else the loss a run logs instead (a
    language model's), else the accuracy to come."""
    found = evaluated(record or {})
    return " | ".join(f"{SHORT[field]} {text}" for field, text in found) or "test acc -"


def evaluated(record: dict) -> list[tuple[str, str]]:
    """(field, text) of the evaluation values an eval.jsonl record or summary.json holds:
    the accuracy alone when there is one, else the losses (a language model's)."""
    if record.get("test_acc") is not None:
        return [("test_acc", f"{100 * record['test_acc']:.2f} %")]
    return [(field, f"{record[field]:.4f}")
            for field in ("test_loss", "train_loss") if record.get(field) is not None]


def share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``, with enough digits to tell small shares apart."""
    if not whole:
        return "-"
    pct = 100 * part / whole
    return f"{pct:.1f}%" if pct >= 1 else f"{pct:.2f}%"
