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
run directory's merge (``psparse.server.records.merge_run_dir``) use them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

__all__ = ["parse_shard", "check_shardable", "bounds", "split_sorted", "shard_dir"]


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
