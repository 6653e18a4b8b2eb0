"""Key-range server shards: which part of the flat parameter vector each server process holds.

With ``--servers S`` (``psparse-server --shard I/S`` by hand) the flat vector of ``numel``
entries is split into S contiguous key ranges, as ps-lite and BytePS split keys across
servers. Shard I of S holds the global indices

    [I * numel // S, (I + 1) * numel // S)

(sizes differ by at most one entry) and speaks the ordinary protocol as if the model had only
that many entries: an index i in a message to or from shard I is the global index
``lo + i`` (shard-relative indices, so every check, encoding and dense switch of a one-server
run applies to a shard unchanged). Workers select over the whole vector, split each push by
range, and concatenate the shards' aggregates (disjoint, ordered ranges: the result is sorted).

Pure helpers, no sockets: the server (its own range), the client (splitting and merging) and the
run-directory merge (``merge_run_dir``) use them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .rundir import EVAL_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl, write_atomic, write_json

__all__ = ["parse_shard", "check_shardable", "bounds", "split_sorted", "shard_dir", "merge_run_dir",
           "MERGED_SUM_FIELDS"]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/S"`` -> (I, S), with 0 <= I < S; ValueError naming the problem otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m:
        raise ValueError(f"--shard {text!r}: expected I/S, this server's shard index I of S "
                         "shards (e.g. 0/2 and 1/2)")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1:
        raise ValueError(f"--shard {text!r}: the number of shards S must be at least 1")
    if not 0 <= index < count:
        raise ValueError(f"--shard {text!r}: the shard index I must be in 0..{count - 1}")
    return index, count


def check_shardable(cfg) -> None:
    """Options that do not work with several key-range shards yet: a ValueError naming the
    option (a clear refusal, not a silent misbehaviour)."""
    if cfg.elastic:
        raise ValueError("--elastic does not work with several server shards yet: each shard "
                         "would decide on its own which workers are still live (use one "
                         "server)")
    if cfg.curve_keys:
        raise ValueError("--curve-keys does not work with several server shards yet (use one "
                         "server, or the run token for admission)")


def bounds(numel: int, count: int) -> np.ndarray:
    """The S + 1 range boundaries: shard I holds [b[I], b[I + 1])."""
    if count > numel:
        raise ValueError(f"{count} server shards for a model of {numel} entries: every shard "
                         "needs at least one")
    return np.array([i * numel // count for i in range(count + 1)], dtype=np.int64)


def split_sorted(indices: np.ndarray, edges: np.ndarray) -> list[slice]:
    """Slices of sorted ``indices`` that fall into each range (one searchsorted)."""
    cut = np.searchsorted(indices, edges[1:-1], side="left")
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), int(indices.size)]
    return [slice(a, b) for a, b in zip(starts, ends)]


def shard_dir(run_dir: Path, index: int) -> Path:
    """Where shard I of a sharded run writes its files (metrics, summary, checkpoints)."""
    return Path(run_dir) / f"shard-{index}"


# Per-iteration fields of the merged metrics.jsonl that are the shards' sum; the rest:
# iter, workers, budget, loss (the same on every shard), k (per worker: summed over shards),
# dense (any shard), round_s and time_s (the slowest shard), and "shards" (per-shard bytes).
MERGED_SUM_FIELDS = ("union", "broadcast_entries", "residual_entries", "upload_bytes",
                     "broadcast_bytes")


def _merge_records(records: list[dict]) -> dict:
    first = records[0]
    out = dict(first)
    for key in MERGED_SUM_FIELDS:
        out[key] = sum(r[key] for r in records)
    out["k"] = [sum(ks) for ks in zip(*(r["k"] for r in records))]
    proposed = [r["proposed"] for r in records]
    out["proposed"] = None if any(p is None for p in proposed) else sum(proposed)
    out["dense"] = any(r["dense"] for r in records)
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
    merged = [_merge_records([m[t] for m in per_shard]) for t in range(rounds)]
    write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in merged))
    write_atomic(run_dir / EVAL_FILE, (dirs[0] / EVAL_FILE).read_text()
                 if (dirs[0] / EVAL_FILE).is_file() else "")
    write_json(run_dir / SUMMARY_FILE, merge_summaries(summaries, merged))
    return True


def merge_summaries(summaries: list[dict], merged: list[dict]) -> dict:
    """The run's summary.json from the shards' (their byte totals summed, union/k from the
    merged per-iteration unions) and the per-shard totals under ``shards``."""
    first = summaries[0]
    out = dict(first)
    failed = [(i, s) for i, s in enumerate(summaries) if s["status"] != "ok"]
    if failed:
        i, s = failed[0]
        out["status"], out["error"] = "failed", f"shard {i}: {s['error']}"
    out["numel"] = sum(s["numel"] for s in summaries)
    out["iterations"] = len(merged)
    for key in ("wall_s", "train_s"):
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = max(values) if values else None
    done = len(merged)
    out["iterations_per_s"] = round(done / out["wall_s"], 3) if done and out["wall_s"] else None
    out["train_iterations_per_s"] = round(done / out["train_s"], 3) \
        if done and out["train_s"] else None
    unions = [r["union"] / max(1, r["budget"]) for r in merged]
    out["union_over_k_mean"] = round(float(np.mean(unions)), 4) if unions else None
    out["union_over_k_max"] = round(float(np.max(unions)), 4) if unions else None
    pushed = [float(np.mean(r["k"])) if r["k"] else 0.0 for r in merged]
    out["pushed_k_mean"] = round(float(np.mean(pushed)), 4) if pushed else None
    for key in ("upload_mb", "broadcast_mb", "dense_mb"):
        out[key] = round(sum(s[key] for s in summaries), 4)
    out["rejected_messages"] = sum(s["rejected_messages"] for s in summaries)
    limits = [s["server_limit"] for s in summaries]
    out["server_limit"] = None if limits[0] is None else {
        "spec": limits[0]["spec"], "held_back": sum(s["held_back"] for s in limits)}
    out.pop("shard", None)
    out.pop("key_range", None)
    out["shards"] = [{"shard": i, "key_range": s["key_range"], "upload_mb": s["upload_mb"],
                      "broadcast_mb": s["broadcast_mb"], "status": s["status"]}
                     for i, s in enumerate(summaries)]
    return out
