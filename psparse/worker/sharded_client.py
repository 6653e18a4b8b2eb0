"""One worker's connections to S key-range server shards, with ``PSClient``'s interface.

``ShardedClient`` splits every push and proposal by key range (``psparse.wire.keyranges``), sends
each shard its part through a ``PSClient`` of its own, and merges the shards' answers into one
message over the whole vector (``frames.merge_aggregates``), so the session above
sees one server (docs/cli.md, "Server shards"). ``open_client`` picks the one or the other.
"""

from __future__ import annotations

import numpy as np

from ..config import ConfigError, RunConfig
from ..server.aggregation import agg_kernels, top_k
from ..wire import keyranges, protocol, run_description
from .client import PSClient
from .frames import RoundedValues, global_indices, merge_aggregates


class ShardedClient:
    """One worker's connections to S key-range server shards (``psparse.wire.keyranges``), with
    ``PSClient``'s interface: the session sees one server and the whole flat vector.

    A push is split by range (one searchsorted of the sorted indices), each part sent to its
    shard in shard-relative indices, and the S aggregates are concatenated back into global
    indices (the ranges are disjoint and ordered, so the merged union is sorted and equals a
    one-server run's). Every message goes to every shard first, then the answers are awaited,
    so the shards work in parallel. In a two-phase round each shard answers a proposal with
    its best indices and their scores (``candidates``); every worker keeps the ``keep`` of
    largest score over all shards, ties to the lower index (the server's vote rule), so all
    workers keep the same set, and the one a single server would keep.
    """

    def __init__(self, addresses: list[tuple[str, int]], rank: int, world_size: int, *,
                 numel: int, edges: list[int] | None = None, **options):
        self.rank, self.world_size, self.numel = rank, world_size, numel
        self.count = len(addresses)
        self.edges = keyranges.bounds(numel, self.count, edges)  # (--shard-edges: edges)
        self.shards: list[PSClient] = []
        try:
            for index, (host, port) in enumerate(addresses):
                self.shards.append(PSClient(
                    host, port, rank, world_size, numel=int(self.edges[index + 1]
                                                            - self.edges[index]),
                    shard=(index, self.count), **options))
        except BaseException:
            self.close()
            raise
        self.timeout = self.shards[0].timeout

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.shards)

    @sent_bytes.setter
    def sent_bytes(self, value) -> None:  # restored from a checkpoint: the total, on shard 0
        for n, c in enumerate(self.shards):
            c.sent_bytes = value if n == 0 else 0

    @property
    def received_bytes(self) -> int:
        return sum(c.received_bytes for c in self.shards)

    @received_bytes.setter
    def received_bytes(self, value) -> None:
        for n, c in enumerate(self.shards):
            c.received_bytes = value if n == 0 else 0

    def _parts(self, indices: np.ndarray):
        """(shard client, slice of ``indices``, that slice made shard-relative in the shard's
        wire dtype) per shard: one pass over each slice (``agg_kernels.shifted_copy``)."""
        parts = []
        for n, (c, part) in enumerate(zip(self.shards, keyranges.split_sorted(indices,
                                                                              self.edges))):
            local = np.empty(part.stop - part.start, dtype=c.index_dtype)
            agg_kernels.shifted_copy(indices, part.start, part.stop, -int(self.edges[n]),
                                     local, 0)
            parts.append((c, part, local))
        return parts

    def register(self, run: dict, checksum: str, start: int) -> protocol.Message:
        for c in self.shards:
            c.send_register(run, checksum, start)
        readies = [c.await_ready() for c in self.shards]
        self.run = readies[0]["run"]  # the agreed run: its steps say how many indices to keep
        for n, c in enumerate(self.shards):  # a shard's push indices start at its edge
            c.key_offset = int(self.edges[n])
        return readies[0]

    @property
    def feedback(self):
        return self.shards[0].feedback

    @property
    def value_format(self):  # the run's (every shard's ready carries the same run)
        return self.shards[0].value_format

    @feedback.setter
    def feedback(self, feed_back) -> None:  # each shard's rounding error, at global indices
        for c in self.shards:
            c.feedback = feed_back

    def propose(self, it: int, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        for c, part, local in self._parts(indices):
            c.send_propose(it, local, values[part])
        got = [c.await_candidates(it) for c in self.shards]
        keys = global_indices([m.indices for m in got], self.edges)
        scores = np.concatenate([m.values for m in got])
        keep = run_description.step_at(self.run, it)[1]  # the push cap: what the group keeps
        if keep >= keys.size:
            return keys
        return keys[top_k(scores, keep, nonnegative=True)]

    def push(self, it: int, indices: np.ndarray, values: np.ndarray, loss: float | None,
             checksum: str | None, dense_buffer: np.ndarray | None = None,
             overflow: bool = False) -> protocol.Message:
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        for n, (c, part, local) in enumerate(self._parts(indices)):
            lo = int(self.edges[n])
            c.send_push(it, local, values.shard(n) if isinstance(values, RoundedValues)
                        else values[part], loss, checksum,
                        None if dense_buffer is None else dense_buffer[lo:lo + c.numel],
                        overflow)  # every shard sees the overflow, so every shard skips
        got = [c.await_aggregate(it) for c in self.shards]
        return merge_aggregates(got, self.edges)

    def report(self, it: int, values: dict, checksum: str | None = None) -> None:
        for c in self.shards:
            c.report(it, values, checksum)

    def finish(self, it: int, values: dict, checksum: str) -> None:
        for c in self.shards:
            c.report(it, {**values, "final": True}, checksum)
        for c in self.shards:
            c.await_shutdown()

    def give_up(self, cause: str) -> None:
        for c in self.shards:
            c.give_up(cause)

    def request_stop(self) -> None:  # every shard ends the run with the same round
        for c in self.shards:
            c.request_stop()

    def cache_state(self):
        return [c.cache.state() for c in self.shards]

    def restore_cache(self, state) -> None:
        for c, part in zip(self.shards, state):
            c.cache.restore(part)

    def close(self) -> None:
        for c in self.shards:
            c.close()


def open_client(cfg: RunConfig, server, rank: int, numel: int, run_token: str | None):
    """The connection to the server, or to S key-range shards (a list of addresses, in shard
    order): (client, how many servers)."""
    servers = server if isinstance(server, list) else [server]
    if cfg.servers > 1 and len(servers) != cfg.servers:
        raise ConfigError(f"the run has {cfg.servers} server shards (--servers) but this "
                          f"worker was given {len(servers)} server address(es): give "
                          "every shard's HOST:PORT, comma-separated, in shard order")
    options = dict(timeout=cfg.timeout, max_message_bytes=int(cfg.max_message_mb * 1e6),
                   curve_keys=cfg.curve_keys, run_token=run_token)
    if len(servers) == 1:
        host, port = servers[0]
        return PSClient(host, port, rank, cfg.workers, numel=numel, **options), 1
    try:
        edges = keyranges.parse_edges(cfg.shard_edges, len(servers))
        return ShardedClient(servers, rank, cfg.workers, numel=numel, edges=edges,
                             **options), len(servers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
