"""What a server writes about a run: metrics.jsonl, eval.jsonl, summary.json, and the shards' merge.

What a server writes about a run: metrics.jsonl (one record per iteration), eval.jsonl (the
evaluator's reports), summary.json, and for S key-range shards the merge of their files into
the run directory's own (docs/run-directory.md).

One rule makes a summary from per-iteration records (``summarize``), whether the records are
one server's or the shards' merged ones; one rule merges the shards' records of an iteration
(``merge_records``), which the launcher's progress line uses too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..rundir import (
    EVAL_FILE,
    EVAL_MEASURES,
    EVAL_VALUES,
    METRICS_FILE,
    SUMMARY_FILE,
    open_truncated,
    read_jsonl,
    ring_allreduce_bytes,
    write_atomic,
    write_json,
)
from ..wire.keyranges import shard_dir

# Per-iteration fields of the merged metrics.jsonl that are the shards' sum; the rest:
# iter, workers, budget, loss (the same on every shard), k (per worker: summed over shards),
# dense (any shard), round_s and time_s (the slowest shard), and "shards" (per-shard bytes).
MERGED_SUM_FIELDS = ("union", "broadcast_entries", "residual_entries", "upload_bytes",
                     "broadcast_bytes", "upload_value_bytes", "broadcast_value_bytes")


def figures(record: dict) -> tuple[float, float, float | None]:
    """What a summary keeps of an iteration's record: (union/k, mean entries pushed, loss)."""
    return (record["union"] / max(1, record["budget"]),
            float(np.mean(record["k"])) if record["k"] else 0.0, record.get("loss"))


def summarize(rounds: list[tuple]) -> dict:
    """The summary fields that follow from the iterations' ``figures``: how many, union/k (mean,
    max), the mean entries pushed, the last loss."""
    unions = [u for u, _, _ in rounds]
    pushed = [p for _, p, _ in rounds]
    losses = [loss for _, _, loss in rounds if loss is not None]
    return {"iterations": len(rounds),
            "union_over_k_mean": round(float(np.mean(unions)), 4) if unions else None,
            "union_over_k_max": round(float(np.max(unions)), 4) if unions else None,
            "pushed_k_mean": round(float(np.mean(pushed)), 4) if pushed else None,
            "final_loss": losses[-1] if losses else None}


def pace(done: int, seconds: float | None) -> float | None:
    return round(done / seconds, 3) if done and seconds else None


class Records:
    """One server's files, its totals, the final reports and the last evaluation."""

    def __init__(self, out_dir: Path | None):
        self.out_dir = out_dir
        self.rounds: list[tuple] = []  # each iteration's figures (resumed ones too)
        self.totals = {"upload_bytes": 0, "broadcast_bytes": 0, "upload_value_bytes": 0,
                       "broadcast_value_bytes": 0}
        self.finals: dict[int, dict] = {}
        self.last_eval: dict | None = None
        self.rejected = 0
        self.t0 = time.perf_counter()
        self._metrics = self._eval = None

    def open(self, resumed_at: int | None) -> None:
        """Open the JSON-lines files; a resumed run drops what came after its checkpoint (rank
        0 sends the evaluation of the checkpoint's last iteration again)."""
        if not self.out_dir:
            return
        self._metrics = open_truncated(self.out_dir / METRICS_FILE,
                                       lambda n, rec: resumed_at is not None and n < resumed_at)
        self._eval = open_truncated(self.out_dir / EVAL_FILE,
                                    lambda n, rec: resumed_at is not None
                                    and rec["iter"] < resumed_at - 1)

    def close(self) -> None:
        for fh in (self._metrics, self._eval):
            if fh:
                fh.close()

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 6)

    def account(self, record: dict) -> None:
        """One iteration's record: into the totals and metrics.jsonl."""
        self.totals["upload_bytes"] += record["upload_bytes"]
        self.totals["broadcast_bytes"] += record["broadcast_bytes"]
        for key in ("upload_value_bytes", "broadcast_value_bytes"):
            self.totals[key] = self.totals.get(key, 0) + record[key]
        self.totals["train_s"] = record["time_s"]
        self.rounds.append(figures(record))
        if self._metrics:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def report(self, rank: int, report: dict, it: int, checksum, evaluator: int) -> None:
        """A worker's metrics message: a final report, or (the evaluator's only) an
        evaluation into eval.jsonl."""
        record = {"iter": it}
        for key in EVAL_VALUES:
            v = report.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
                record[key] = v
        if report.get("final"):
            self.finals[rank] = {"checksum": checksum, **record}
        # only the evaluator's results are the run's: another rank's cannot overwrite them
        if rank == evaluator and any(key in record for key in EVAL_MEASURES):
            record["time_s"] = self.elapsed()
            self.last_eval = record
            if self._eval:
                self._eval.write(json.dumps(record) + "\n")
                self._eval.flush()

    def state(self) -> dict:
        """What a checkpoint keeps of the records."""
        return {"rounds": self.rounds, "totals": self.totals, "rejected": self.rejected,
                "last_eval": self.last_eval, "elapsed": time.perf_counter() - self.t0}

    def restore(self, state: dict) -> None:
        self.totals, self.rejected = state["totals"], state["rejected"]
        if "rounds" in state:
            self.rounds = [tuple(r) for r in state["rounds"]]
        else:  # a checkpoint of the server before psparse/server/ (its totals held lists)
            t = self.totals
            unions, pushed, losses = t.pop("union", []), t.pop("pushed", []), t.pop("loss", [])
            pushed = pushed + [0.0] * (len(unions) - len(pushed))
            self.rounds = [(u, p, None) for u, p in zip(unions, pushed)]
            if self.rounds and losses:  # the summary reads the last loss only
                self.rounds[-1] = (*self.rounds[-1][:2], losses[-1])
        self.last_eval = state["last_eval"]
        self.t0 = time.perf_counter() - state["elapsed"]

    def summary(self, status: str, error: str | None, *, ended: str | None, world_size: int,
                numel: int, k: int, members, limit, shard=None) -> dict:
        """summary.json's fields (docs/run-directory.md)."""
        t = self.totals
        wall = time.perf_counter() - self.t0
        done = len(self.rounds)
        dense_round = 2 * world_size * numel * 4  # float32 up and down, every worker
        derived = summarize(self.rounds)
        summary = {
            "status": status, "error": error, "ended": ended, "world_size": world_size,
            "numel": numel,
            "k": k, "iterations": done, "wall_s": round(wall, 3),
            "iterations_per_s": pace(done, wall),
            # training alone: to the last round's aggregate (wall_s also holds the final
            # evaluation and the end of the run, which make short runs look slower)
            "train_s": t.get("train_s"), "train_iterations_per_s": pace(done, t.get("train_s")),
            "union_over_k_mean": derived["union_over_k_mean"],
            "union_over_k_max": derived["union_over_k_max"],
            "pushed_k_mean": derived["pushed_k_mean"],
            "upload_mb": round(t["upload_bytes"] / 1e6, 4),
            "broadcast_mb": round(t["broadcast_bytes"] / 1e6, 4),
            # of which value frames (the rest: index frames and headers)
            "upload_value_mb": round(t.get("upload_value_bytes", 0) / 1e6, 4),
            "broadcast_value_mb": round(t.get("broadcast_value_bytes", 0) / 1e6, 4),
            "dense_mb": round(done * dense_round / 1e6, 4),
            "allreduce_mb": round(done * ring_allreduce_bytes(world_size, numel) / 1e6, 4),
            "final_loss": derived["final_loss"],
            "test_acc": self.last_eval.get("test_acc") if self.last_eval else None,
            "test_loss": self.last_eval.get("test_loss") if self.last_eval else None,
            "rejected_messages": self.rejected,
            "lost_workers": members.lost,
            "evaluators": members.evaluators,
            "server_limit": None if limit is None else
            {"spec": "".join(str(x) for x in limit.spec), "held_back": int(limit.support.size)},
        }
        if shard is not None:
            summary["shard"], summary["key_range"] = shard
        return summary

    def write_summary(self, summary: dict) -> None:
        if self.out_dir:
            write_json(self.out_dir / SUMMARY_FILE, summary)


# -------------------------------------------------------------------------- the shards' merge
def merge_records(records: list[dict]) -> dict:
    """One iteration's record of a sharded run from its S shards' records."""
    first = records[0]
    out = dict(first)
    for key in MERGED_SUM_FIELDS:
        out[key] = sum(r[key] for r in records)
    if any("ranks" in r for r in records):  # (shards that disagree on who pushed this round)
        every = range(max(len(r["k"]) for r in records))
        per_rank: dict[int, int] = {}
        for r in records:
            for rank, k in zip(r.get("ranks", every), r["k"]):
                per_rank[rank] = per_rank.get(rank, 0) + k
        out["ranks"] = sorted(per_rank)
        out["k"] = [per_rank[rank] for rank in out["ranks"]]
        if any("ranks" not in r for r in records) and out["ranks"] == list(every):
            del out["ranks"]  # every rank's, as a record without the field says
    else:
        out["k"] = [sum(ks) for ks in zip(*(r["k"] for r in records))]
    proposed = [r["proposed"] for r in records]
    out["proposed"] = None if any(p is None for p in proposed) else sum(proposed)
    if first.get("proposals") is not None:  # each rank's proposals, over every shard
        out["proposals"] = [sum(c) for c in zip(*(r["proposals"] for r in records))]
    out["dense"] = any(r["dense"] for r in records)
    out["workers"] = min(r["workers"] for r in records)
    lives = [set(r["live"]) for r in records if "live" in r]
    if lives:  # (an elastic loss: a rank any shard lost is lost, as the workers take it)
        out["live"] = sorted(set.intersection(*lives))
    out["round_s"] = max(r["round_s"] for r in records)
    out["time_s"] = max(r["time_s"] for r in records)
    out["shards"] = [{"upload_bytes": r["upload_bytes"], "broadcast_bytes": r["broadcast_bytes"],
                      "union": r["union"]} for r in records]
    return out


def merge_run_dir(run_dir: Path, count: int) -> bool:
    """Write RUN_DIR's metrics.jsonl, eval.jsonl and summary.json from the S shards' own files
    (RUN_DIR/shard-I/), once every shard has written its summary.json. Returns whether it did.

    Idempotent (the same input gives the same files, written atomically), so every shard may
    call it when it finishes and the launcher again at the end.
    """
    run_dir = Path(run_dir)
    dirs = [shard_dir(run_dir, i) for i in range(count)]
    if not all((d / SUMMARY_FILE).is_file() for d in dirs):
        return False
    summaries = [json.loads((d / SUMMARY_FILE).read_text()) for d in dirs]
    per_shard = [read_jsonl(d / METRICS_FILE) for d in dirs]
    rounds = min(len(m) for m in per_shard)
    merged = [merge_records([m[t] for m in per_shard]) for t in range(rounds)]
    write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in merged))
    write_atomic(run_dir / EVAL_FILE, (dirs[0] / EVAL_FILE).read_text()
                 if (dirs[0] / EVAL_FILE).is_file() else "")
    write_json(run_dir / SUMMARY_FILE, merge_summaries(summaries, merged))
    return True


def merge_losses(per_shard: list[list[dict]]) -> list[dict]:
    """An elastic run's lost workers over its shards: each rank once, at the first iteration
    a shard lost it (a shard that got its push before it fell silent loses it a round
    later), in the order they were lost (None, after the last iteration, last)."""
    first: dict[int, int | None] = {}
    for losses in per_shard:
        for loss in losses:
            r, it = loss["rank"], loss["iter"]
            if r not in first or (it is not None and (first[r] is None or it < first[r])):
                first[r] = it
    order = sorted(first, key=lambda r: (first[r] is None, first[r] or 0, r))
    return [{"rank": r, "iter": first[r]} for r in order]


def merge_evaluators(per_shard: list[list[dict]]) -> list[dict]:
    """Which rank evaluated from when, over the shards: each hand-over at the first iteration
    a shard made it (the workers evaluate by the ranks every shard still has)."""
    first: dict[int, int] = {}
    for hand_overs in per_shard:
        for h in hand_overs:
            first[h["rank"]] = min(first.get(h["rank"], h["from_iter"]), h["from_iter"])
    return [{"rank": r, "from_iter": first[r]} for r in sorted(first, key=lambda r: (first[r], r))]


def merge_summaries(summaries: list[dict], merged: list[dict]) -> dict:
    """The run's summary.json from the shards' (their byte totals summed, union/k from the
    merged per-iteration records) and the per-shard totals under ``shards``."""
    out = dict(summaries[0])
    failed = [(i, s) for i, s in enumerate(summaries) if s["status"] != "ok"]
    if failed:
        i, s = failed[0]
        out["status"], out["error"] = "failed", f"shard {i}: {s['error']}"
        out.pop("failed_ranks", None)
        if "failed_ranks" in s:
            out["failed_ranks"] = s["failed_ranks"]
        out["ended"] = "failed"
    out["numel"] = sum(s["numel"] for s in summaries)
    for key in ("wall_s", "train_s"):
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = max(values) if values else None
    derived = summarize([figures(r) for r in merged])
    done = derived["iterations"]
    out["iterations"] = done
    out["iterations_per_s"] = pace(done, out["wall_s"])
    out["train_iterations_per_s"] = pace(done, out["train_s"])
    for key in ("union_over_k_mean", "union_over_k_max", "pushed_k_mean"):
        out[key] = derived[key]
    for key in ("upload_mb", "broadcast_mb", "upload_value_mb", "broadcast_value_mb",
                "dense_mb", "allreduce_mb"):
        out[key] = round(sum(s[key] for s in summaries), 4)
    out["rejected_messages"] = sum(s["rejected_messages"] for s in summaries)
    out["lost_workers"] = merge_losses([s.get("lost_workers", []) for s in summaries])
    out["evaluators"] = merge_evaluators([s.get("evaluators", []) for s in summaries])
    limits = [s["server_limit"] for s in summaries]
    out["server_limit"] = None if limits[0] is None else {
        "spec": limits[0]["spec"], "held_back": sum(s["held_back"] for s in limits)}
    if summaries[0].get("values") is not None and summaries[0]["values"]["held_l1"] is not None:
        out["values"] = {**summaries[0]["values"], "held_l1": round(sum(
            s["values"]["held_l1"] for s in summaries), 6)}
    out.pop("shard", None)
    out.pop("key_range", None)
    out["shards"] = [{"shard": i, "key_range": s["key_range"], "upload_mb": s["upload_mb"],
                      "broadcast_mb": s["broadcast_mb"], "status": s["status"]}
                     for i, s in enumerate(summaries)]
    return out
