"""Key-range server shards: which part of the flat parameter vector each server process holds.

With ``--servers S`` (``psparse-server --shard I/S`` by hand) the flat vector of ``numel``
entries is split into S contiguous key ranges, as ps-lite and BytePS split keys across
servers. Shard I of S holds the global indices

    [I * numel // S, (I + 1) * numel // S)

(sizes differ by at most one entry), or [E_I, E_I+1) when the run gives the boundaries
(``--shard-edges``, the run description's ``shard_edges``: equal ranges are not equal load;
``balanced_edges`` proposes boundaries from a run's recorded selections), and speaks the
ordinary protocol as if the model had only that many entries: an index i in a message to or from shard I is the global index
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

__all__ = ["parse_shard", "parse_edges", "bounds", "balanced_edges",
           "split_sorted", "shard_dir"]


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


def parse_edges(text: str | None, count: int) -> list[int] | None:
    """``--shard-edges "E1,E2,..."`` -> [E1, ..., E(S-1)] (None: equal ranges); ValueError
    naming the problem. The model's size is checked by ``bounds``."""
    if text is None:
        return None
    if count < 2:
        raise ValueError("--shard-edges needs --servers S with S >= 2 (it places the S - 1 "
                         "boundaries between the shards' key ranges)")
    try:
        edges = [int(e) for e in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--shard-edges {text!r}: expected S - 1 comma-separated keys, e.g. "
                         "1000,2500,4000 for 4 shards") from None
    if len(edges) != count - 1 or edges[0] < 1 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--shard-edges {text!r}: expected {count - 1} strictly increasing "
                         f"keys >= 1 for {count} shards (the boundaries between their ranges)")
    return edges


def bounds(numel: int, count: int, edges: list[int] | None = None) -> np.ndarray:
    """The S + 1 range boundaries: shard I holds [b[I], b[I + 1]); equal ranges unless the
    run gives the S - 1 ``edges`` between them (``--shard-edges``, the run's ``shard_edges``)."""
    if count > numel:
        raise ValueError(f"{count} server shards for a model of {numel} entries: every shard "
                         "needs at least one")
    if edges is None:
        return np.array([i * numel // count for i in range(count + 1)], dtype=np.int64)
    if len(edges) != count - 1 or any(a >= b for a, b in zip([0, *edges], [*edges, numel])):
        raise ValueError(f"shard edges {edges} do not split a model of {numel} entries into "
                         f"{count} non-empty key ranges (S - 1 increasing keys in 1..{numel - 1})")
    return np.array([0, *edges, numel], dtype=np.int64)


def balanced_edges(load: np.ndarray, count: int) -> list[int]:
    """The S - 1 boundaries that give S contiguous ranges about the same total ``load`` (one
    weight per key: the entries it made in the pushes and broadcasts), each range at least one
    key. Each boundary goes where the range so far comes closest to the load still to place
    over the shards still to fill, so a heavy key early on does not unbalance the rest."""
    load = np.asarray(load, dtype=np.float64)
    numel = load.size
    if count > numel:
        raise ValueError(f"{count} shards for {numel} keys")
    cumulative = np.concatenate([[0.0], np.cumsum(load)])  # cumulative[i]: load of keys < i
    edges, lo = [], 0
    for i in range(1, count):
        left = count - i + 1  # shards still to fill, this one included
        if cumulative[-1] - cumulative[lo] <= 0:  # no load left: equal sizes
            edge = lo + (numel - lo) // left
        else:
            target = cumulative[lo] + (cumulative[-1] - cumulative[lo]) / left
            after = int(np.searchsorted(cumulative, target, side="left"))  # first at or past
            before = after - 1
            edge = after if after <= numel and (
                before <= lo or cumulative[after] - target < target - cumulative[before]) \
                else before
        edge = min(max(edge, lo + 1), numel - (count - i))  # every range non-empty
        edges.append(edge)
        lo = edge
    return edges


def split_sorted(indices: np.ndarray, edges: np.ndarray) -> list[slice]:
    """Slices of sorted ``indices`` that fall into each range (one searchsorted)."""
    cut = np.searchsorted(indices, edges[1:-1], side="left")
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), int(indices.size)]
    return [slice(a, b) for a, b in zip(starts, ends)]


def shard_dir(run_dir: Path, index: int) -> Path:
    """Where shard I of a sharded run writes its files (metrics, summary, checkpoints)."""
    return Path(run_dir) / f"shard-{index}"
