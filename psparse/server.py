"""The parameter server: registration, synchronous sparse aggregation, accounting.

One ROUTER socket. Phase 1: wait for N workers to register (each proving the run token when the
server has one; a rank is bound to the first peer that proves it, and freed again if that peer
leaves before training) and check they agree on the run (docs/protocol.md, "The run"). Phase 2:
for every iteration, collect exactly one push per worker, no larger than the agreed budget, sum
them in rank order (so the result is bit-reproducible), divide by N, and send the mean at the
union of the pushed indices to every worker. Phase 3: collect every worker's final checksum,
write summary.json, tell the workers to stop.

Every wait is bounded by ``timeout``; a bad message is answered with an ``error`` message and
otherwise ignored, so a misbehaving peer cannot stop or corrupt the run of well-behaved workers.

With ``--shard I/S`` the server is one of S key-range shards (psparse/keyranges.py): it serves
keys [I*numel//S, (I+1)*numel//S) in shard-relative indices, answers proposals with
``candidates`` (its best indices with their scores) instead of ``indices``, and keeps its files in
RUN_DIR/shard-I/; the last shard to finish merges the run's files.

A run whose description has ``parts`` (buckets of layers, ``--bucket-mb`` / ``--overlap``) is
served part by part: every rank pushes each part, and each part is averaged and broadcast as
soon as every rank has pushed it (``serve_parts``), so workers get the later layers' aggregate
while backward still runs; docs/protocol.md, Parts.

This module keeps the socket, the round sequence, accounting, checkpoints and the summary; who is
in the run (admission, agreement, liveness, losses) is ``membership.Membership``, and the round
arithmetic (sparse mean, vote, budgets, dense switch, size limit) is ``aggregation``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from . import checkpoint, keyranges, protocol
from .aggregation import Aggregator, BudgetError, ServerLimit, array_module_for
from .codec import KeyCache
from .config import SERVER_CONFIG, bucket_refusal, parse_limit
from .kernels import sparse_mean  # noqa: F401 (tests/test_limits.py imports it from here)
from .membership import Membership, RunAborted
from .options import add_config_arguments, parse_with_config
from .protocol import ProtocolError
from .rundir import (
    EVAL_FILE,
    EVAL_VALUES,
    METRICS_FILE,
    PORT_FILE,
    SUMMARY_FILE,
    open_truncated,
    write_atomic,
    write_json,
)
from .transport import (
    Channel,
    Pacer,
    PeerGone,
    TransportTimeout,
    is_loopback,
    parse_rate,
    warn,
    wire_bytes,
)


class Server:
    def __init__(self, world_size: int, *, bind: str = "127.0.0.1", port: int = 0,
                 out_dir: str | Path | None = None, timeout: float = 60.0,
                 max_message_bytes: int = 1 << 30, limit: str | None = None,
                 curve_keys: str | None = None, elastic: bool = False,
                 register_timeout: float = 120.0, checkpoint_every: int = 0,
                 resume: bool = False, device: str = "cpu", run_token: str | None = None,
                 shard: tuple[int, int] = (0, 1), log=None):
        self.world_size = world_size
        # key-range shard I of S (psparse/keyranges.py): this server holds [lo, hi) of the flat
        # vector, speaks in shard-relative indices, and keeps its files in RUN_DIR/shard-I/
        self.shard = shard
        self.sharded = shard[1] > 1
        self.key_range = (0, 0)
        self.dev = array_module_for(device)  # cuda: sum the pushes on the GPU (a backend)
        self.checkpoint_every = checkpoint_every
        self.start = 0  # first iteration to serve (> 0 when resuming)
        self.resume = resume
        self.register_timeout = register_timeout
        self.heartbeat_s = timeout / 5  # several beats fit in one timeout
        self.patience = 10  # a wait ends after 10 x timeout even if everyone heartbeats
        self._last_heartbeat = 0.0
        self._wait_start = time.monotonic()
        self.limit_spec = parse_limit(limit) if limit else None
        self.link: Pacer | None = None  # --bandwidth emulation of the server's link
        self.limit: ServerLimit | None = None
        self.timeout = timeout
        self.channel = Channel.server(bind, port, max_message_bytes=max_message_bytes,
                                      send_timeout_s=timeout, curve_keys=curve_keys)
        self.run_dir = Path(out_dir) if out_dir else None
        self.out_dir = keyranges.shard_dir(self.run_dir, shard[0]) \
            if self.run_dir and self.sharded else self.run_dir  # this server's own files
        name = f"server {shard[0]}/{shard[1]}" if self.sharded else "server"
        self.log = log or (lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
        # who is in the run; it probes a peer's connection through the server's socket
        self.members = Membership(world_size, reachable=self._reachable, run_token=run_token,
                                  timeout=timeout, elastic=elastic, log=self.log)
        self.aggregator: Aggregator | None = None  # from registration on (numel is known then)
        self.parts: list[int] | None = None  # a run in parts: the boundaries of its key ranges
        self.numel = 0
        self.iterations = 0
        self.rejected = 0
        self._metrics_fh = self._eval_fh = None
        self._finals: dict[int, dict] = {}
        self._last_eval: dict | None = None
        self.k = 0
        self.run_description: dict | None = None  # the agreed run, from the registrations
        self._totals = {"upload_bytes": 0, "broadcast_bytes": 0, "union": [], "loss": [],
                        "pushed": []}
        self._t0 = time.perf_counter()

    @property
    def port(self) -> int:
        return self.channel.port

    # ------------------------------------------------------------------------------- main loop
    def run(self) -> int:
        """Serve one training run; returns the process exit code (0 ok, 1 aborted)."""
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            saved = self._resume_point() if self.resume else None
            self._metrics_fh = open_truncated(self.out_dir / METRICS_FILE,
                                               lambda n, rec: saved is not None and n < saved)
            # rank 0 sends the evaluation of the checkpoint's last iteration again on resume
            self._eval_fh = open_truncated(self.out_dir / EVAL_FILE,
                                            lambda n, rec: saved is not None
                                            and rec["iter"] < saved - 1)
            write_atomic(self.out_dir / PORT_FILE, f"{self.port}\n")
            if self.sharded:  # the merge waits for every shard's summary of this run
                (self.out_dir / SUMMARY_FILE).unlink(missing_ok=True)
        elif self.resume:
            raise ValueError("resuming needs the run directory (--out)")
        self.log(f"listening on port {self.port} for {self.world_size} workers"
                 + (f" (key-range shard {self.shard[0]} of {self.shard[1]})"
                    if self.sharded else ""))
        try:
            self.register_workers()
            if self.resume:
                self._restore()
            for it in range(self.start, self.iterations):
                self.serve_round(it)
                if self.checkpoint_every and (it + 1) % self.checkpoint_every == 0 \
                        and it + 1 < self.iterations:
                    self._checkpoint(it + 1)
            self.finish()
            return 0
        except RunAborted as exc:
            self.abort(str(exc))
            return 1
        finally:
            for fh in (self._metrics_fh, self._eval_fh):
                if fh:
                    fh.close()
            self.channel.close()

    def _wait(self, what: str, deadline: float, waiting_for=(), it: int | None = None):
        """Next message as (peer, frames, nbytes).

        Ranks in ``waiting_for`` are declared lost once nothing (message or heartbeat) came from
        them for ``timeout`` seconds; ``deadline`` bounds the whole wait in any case, so a worker
        that heartbeats but never sends cannot hang the run either.
        """
        members = self.members
        while True:
            now = time.monotonic()
            lost = members.silent(waiting_for, now)
            if lost:
                members.lose(lost, it, what)
                return None
            if now >= deadline:
                raise RunAborted(f"timed out after {deadline - self._wait_start:.0f} s waiting "
                                 f"for {what}")
            if self.heartbeat_s and now - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = now  # tell waiting workers the server is alive
                beat = protocol.encode("heartbeat")
                gone = []
                for r in members.connected():
                    try:
                        self.channel.send(beat, members.rank_peer[r])
                    except PeerGone:  # ROUTER_MANDATORY: this peer's connection closed
                        if members.training:
                            gone.append(r)
                        else:  # registered, then left: free the rank
                            members.unbind(r, "its connection closed")
                    except TransportTimeout:
                        pass  # connected but not reading: silence decides, above
                if gone:
                    members.lose(gone, it, what, "its connection closed (the worker has gone)")
                    return None
            step = min(deadline - now, self.heartbeat_s or deadline - now, 0.5)
            got = self.channel.recv(max(step, 0.0))
            if got is not None:
                members.seen(got[0])
                return got

    # ---------------------------------------------------------------------- checkpoint, resume
    def _resume_point(self) -> int:
        it = checkpoint.latest_common(self.run_dir, self.world_size, self.shard[1])
        if it is None:
            raise ValueError(f"no checkpoint in {self.run_dir} that the server"
                             + (f" shards (all {self.shard[1]})" if self.sharded else "")
                             + f" and all {self.world_size} workers saved")
        self.start = it
        return it

    def _checkpoint(self, iteration: int) -> None:
        checkpoint.save(self.out_dir, "server", iteration, {
            "iteration": iteration,
            "totals": self._totals, "rejected": self.rejected, "last_eval": self._last_eval,
            "active": sorted(self.members.active), "lost": self.members.lost,
            "evaluators": self.members.evaluators,
            "caches": {r: c.state() for r, c in self.caches.items()},
            "limit": None if self.limit is None else
            {"support": self.limit.support, "values": self.limit.residual[self.limit.support]},
            "elapsed": time.perf_counter() - self._t0,
        })

    def _restore(self) -> None:
        state = checkpoint.load(self.out_dir, "server", self.start)
        self._totals, self.rejected = state["totals"], state["rejected"]
        self._totals.setdefault("pushed", [])
        members = self.members
        members.evaluators = state.get("evaluators", members.evaluators)
        self._last_eval, members.lost = state["last_eval"], state["lost"]
        members.active = set(state["active"])
        for r, c in state["caches"].items():
            self.caches[r].restore(c)
        if state["limit"] is not None:
            self.limit.support = state["limit"]["support"]
            self.limit.residual[self.limit.support] = state["limit"]["values"]
        self._t0 = time.perf_counter() - state["elapsed"]
        self.log(f"resumed at iteration {self.start}")

    def _deadline(self) -> float:
        self._wait_start = time.monotonic()
        return self._wait_start + self.timeout * self.patience

    # -------------------------------------------------------------------------- registration
    def register_workers(self) -> None:
        self._wait_start = time.monotonic()
        deadline = self._wait_start + self.register_timeout
        members = self.members
        while not members.complete():  # every rank bound to a peer that is still there
            peer, frames, _ = self._wait(f"workers to register (missing ranks "
                                         f"{members.missing()})", deadline)
            try:
                msg = protocol.decode(frames)
                self._check_shard(msg)
                members.register(peer, msg)
            except ProtocolError as exc:
                self.reject(peer, exc)
        self.run_description = run = members.agree(self.start)
        try:
            edges = keyranges.bounds(run["numel"], self.shard[1])
        except ValueError as exc:
            raise RunAborted(str(exc)) from None
        self.key_range = (int(edges[self.shard[0]]), int(edges[self.shard[0] + 1]))
        # a shard's messages index its own range: the model it serves has hi - lo entries
        self.numel = self.key_range[1] - self.key_range[0]
        self.iterations = run["iterations"]
        self.two_phase = run["two_phase"]
        self.k = run["steps"][-1][1]  # the configured k (density x numel), the unit of union/k
        self.limit = ServerLimit(self.numel, self.limit_spec) if self.limit_spec else None
        # a round in parts (buckets of layers, docs/protocol.md "Parts"): part p holds keys
        # [parts[p], parts[p + 1]) and is aggregated and broadcast as soon as every rank pushed it
        self.parts = run.get("parts")
        if self.parts is not None:
            self._check_parts_allowed()
            self.part_aggregators = [Aggregator(hi - lo, self.dev)
                                     for lo, hi in zip(self.parts, self.parts[1:])]
        self.aggregator = Aggregator(self.numel, self.dev) if self.parts is None \
            else self.part_aggregators[0]  # the only model-sized buffers (or the parts')
        # per worker (per worker and part): the index sets both ends hold (key caching)
        self.caches = {r: KeyCache() for r in range(self.world_size)} if self.parts is None \
            else {(r, p): KeyCache() for r in range(self.world_size)
                  for p in range(len(self.parts) - 1)}
        members.start_training(self.iterations)
        for rank in range(self.world_size):
            self._send(members.rank_peer[rank], protocol.encode(
                "ready", world_size=self.world_size, start=self.start, run=run,
                token=members.tokens[rank], heartbeat_s=self.heartbeat_s), it=self.start)
        self.log(f"{self.world_size} workers registered: numel={self.numel}, "
                 f"iterations={self.iterations}"
                 + (f", keys [{self.key_range[0]}, {self.key_range[1]}) of {run['numel']}"
                    if self.sharded else ""))
        self._t0 = time.perf_counter()

    def _check_parts_allowed(self) -> None:
        """What a run in parts does not combine with (the workers refuse these options too)."""
        why = bucket_refusal(two_phase=self.two_phase, server_limit=self.limit is not None,
                             elastic=self.members.elastic, shards=self.sharded)
        if why is not None:
            raise RunAborted("the run is exchanged in parts (buckets, --overlap / --bucket-mb), "
                             "which " + why.replace(" {policy}", "").replace("needs", "needs"))

    def _part_scope(self, rank: int | None):
        """decode's scope for a run in parts: a push's part sets its size and key cache."""
        def scope(header):
            if header.get("type") not in ("push",):
                return self.numel, None
            part = header.get("part")
            if part is None:
                raise ProtocolError("this run is exchanged in parts (its run has 'parts'): "
                                    "a push must carry 'part'")
            if part >= len(self.parts) - 1:
                raise ProtocolError(f"push for part {part}, the run has "
                                    f"{len(self.parts) - 1} parts")
            cache = self.caches[(rank, part)] if rank is not None else None
            return self.parts[part + 1] - self.parts[part], cache
        return scope

    def _check_shard(self, msg: protocol.Message) -> None:
        """A register names the shard it is meant for (``shard`` = [I, S]); a one-server run
        accepts none or [0, 1]: a worker cannot push one shard's keys to another."""
        if msg.type != "register":
            return
        claimed = msg.get("shard", [0, 1] if not self.sharded else None)
        if claimed is None:
            raise ProtocolError(f"this server is key-range shard {self.shard[0]} of "
                                f"{self.shard[1]}: a register must carry shard "
                                f"[{self.shard[0]}, {self.shard[1]}] (docs/protocol.md, Server "
                                "shards)")
        if list(claimed) != list(self.shard):
            raise ProtocolError(f"register for shard {claimed[0]} of {claimed[1]}, but this "
                                f"server is shard {self.shard[0]} of {self.shard[1]}")

    def _reachable(self, peer: bytes) -> bool:
        """Whether a peer's connection is still open (ROUTER_MANDATORY refuses a send to a peer
        that has gone); probes with a heartbeat, which workers ignore."""
        try:
            self.channel.send(protocol.encode("heartbeat"), peer)
        except PeerGone:
            return False
        except TransportTimeout:
            pass  # connected, just not reading yet
        return True

    # --------------------------------------------------------------------------------- rounds
    def serve_round(self, it: int) -> None:
        if self.parts is not None:
            return self.serve_parts(it)
        t_start = time.perf_counter()
        agg = self.aggregator
        upload = broadcast = 0
        proposed = None
        if self.two_phase:
            # Phase 1: every worker proposes entries (possibly none); the group keeps the
            # `select` indices of largest mean |value| and every worker pushes there.
            proposals, upload = self._collect(it, "propose")
            self._pace(upload)
            ordered = [proposals[r] for r in sorted(proposals)]
            if self.sharded:  # the shard's best with their scores; workers pick across shards
                keep = protocol.step_at(self.run_description, it)[1]
                chosen, scores, proposed = agg.candidates(
                    [m.indices for m in ordered], [m.values for m in ordered], keep)
                broadcast += self._broadcast("candidates",
                                             chosen.astype(agg.index_dtype, copy=False),
                                             scores, iter=it)
            else:
                chosen, proposed = self.vote(ordered, it)
                broadcast += self._broadcast("indices",
                                             chosen.astype(agg.index_dtype, copy=False),
                                             None, iter=it)
        pushes, push_bytes = self._collect(it, "push")
        upload += push_bytes
        self._pace(push_bytes)
        self._check_checksums(it, {r: m.get("checksum") for r, m in pushes.items()})

        ranks = sorted(pushes)  # all workers, or those still in an elastic run
        ks = [int(pushes[r]["count"]) for r in ranks]
        self._totals["pushed"].append(float(np.mean(ks)) if ks else 0.0)
        # the round's k from the agreed run (lower during a density warm-up): the unit of union/k
        budget = protocol.step_at(self.run_description, it)[0]
        union, mean = self.aggregate([pushes[r] for r in ranks])
        sent_idx, sent_val = union, mean
        if self.limit is not None:
            sent_idx, sent_val = self.limit.apply(
                union, mean, self.limit.entries(budget, len(ranks), self.shard))
        dense = agg.goes_dense(sent_idx.size)
        # after a loss in an elastic run every aggregate names the ranks still in the run
        active = self.members.active
        live = {"live": sorted(active)} if len(active) < self.world_size else {}
        if dense:
            broadcast += self._broadcast("aggregate", None, agg.densify(sent_idx, sent_val),
                                         iter=it, workers=len(ranks), dense=True, **live)
        else:
            sent_idx = sent_idx.astype(agg.index_dtype, copy=False)
            sent_idx.flags.writeable = False  # never changed again: the key caches hold it
            broadcast += self._broadcast("aggregate", sent_idx, sent_val, iter=it,
                                         workers=len(ranks), **live)
        losses = [pushes[r]["loss"] for r in ranks if "loss" in pushes[r].header]
        record = {
            "iter": it,
            "workers": len(ranks),
            "k": ks,
            "budget": budget,
            "union": int(union.size),
            "broadcast_entries": int(sent_idx.size),
            "residual_entries": self.limit.support.size if self.limit is not None else 0,
            "dense": dense,
            "proposed": proposed,
            "upload_bytes": upload,
            "broadcast_bytes": broadcast,
            "loss": float(np.mean(losses)) if losses else None,
            "round_s": round(time.perf_counter() - t_start, 6),
            "time_s": round(time.perf_counter() - self._t0, 6),
        }
        self._account(record)

    def serve_parts(self, it: int) -> None:
        """A round in parts: each part's pushes (one per rank, in any order of parts) are
        averaged and broadcast as soon as every rank has pushed that part, so the workers
        receive the first parts' aggregates while they still compute the others. One
        metrics.jsonl record per iteration, summed over the parts."""
        t_start = time.perf_counter()
        count = len(self.parts) - 1
        got: list[dict[int, protocol.Message]] = [{} for _ in range(count)]
        pushed: dict[int, int] = {}  # rank -> entries pushed this iteration (all parts)
        upload = broadcast = union = sent = 0
        dense_any = False
        budget, push_max, _ = protocol.step_at(self.run_description, it)
        deadline = self._deadline()
        done = 0
        while done < count:
            waiting = {p: sorted(self.members.active - set(got[p])) for p in range(count)
                       if self.members.active - set(got[p])}
            missing = sorted({r for ranks in waiting.values() for r in ranks})
            what = f"push messages of iteration {it} (parts {sorted(waiting)})"
            received = self._wait(f"{what} from ranks {missing}", deadline, missing, it)
            if received is None:
                continue  # cannot happen without --elastic, which parts refuse
            peer, frames, nbytes = received
            msg = self._accept(peer, frames)
            if msg is None or not self._wanted(peer, msg, what, it, "push"):
                continue
            rank, part = msg["rank"], msg["part"]
            if rank in got[part]:
                self.reject(peer, ProtocolError(f"rank {rank} already sent part {part} of "
                                                f"iteration {it}"))
                continue
            agg = self.part_aggregators[part]
            try:
                agg.check_budget("push", it, (budget, push_max, 0), msg["count"],
                                 msg.values if msg.get("dense") else None)
                entries = int(np.count_nonzero(msg.values)) if msg.get("dense") \
                    else int(msg["count"])
                if pushed.get(rank, 0) + entries > push_max:
                    raise BudgetError(f"rank {rank}'s pushes of iteration {it} have "
                                      f"{pushed.get(rank, 0) + entries} entries in all, more "
                                      f"than the push cap of {push_max}")
            except BudgetError as exc:
                self.reject(peer, ProtocolError(str(exc)))
                continue
            pushed[rank] = pushed.get(rank, 0) + entries
            got[part][rank] = msg
            upload += nbytes
            self._pace(nbytes)
            if msg.indices is not None:
                self.caches[(rank, part)].remember(msg.indices, sent=False)
            if self.members.active - set(got[part]):
                continue
            # every rank pushed this part: its mean, broadcast now
            ranks = sorted(got[part])
            idx, mean = agg.mean([None if got[part][r].get("dense") else got[part][r].indices
                                  for r in ranks], [got[part][r].values for r in ranks])
            union += int(idx.size)
            sent += int(idx.size)
            fields = dict(iter=it, workers=len(ranks), part=part)
            if agg.goes_dense(idx.size):
                dense_any = True
                broadcast += self._broadcast("aggregate", None, agg.densify(idx, mean),
                                             dense=True, **fields)
            else:
                broadcast += self._broadcast("aggregate", idx.astype(agg.index_dtype, copy=False),
                                             mean, model_size=agg.numel, **fields)
            done += 1
        pushes = [m for part in got for m in part.values()]
        checksums: dict[int, str | None] = {}
        for m in pushes:  # one checksum per rank and iteration (any part may carry it)
            if m.get("checksum") is not None:
                if checksums.get(m["rank"], m["checksum"]) != m["checksum"]:
                    raise RunAborted(f"rank {m['rank']} sent two checksums for iteration {it}")
                checksums[m["rank"]] = m["checksum"]
        self._check_checksums(it, checksums)
        ranks = sorted(self.members.active)
        ks = [sum(int(got[p][r]["count"]) for p in range(count)) for r in ranks]
        self._totals["pushed"].append(float(np.mean(ks)) if ks else 0.0)
        losses = [m["loss"] for m in pushes if "loss" in m.header]
        self._account({
            "iter": it, "workers": len(ranks), "k": ks, "budget": budget, "union": union,
            "broadcast_entries": sent, "residual_entries": 0, "dense": dense_any,
            "proposed": None, "upload_bytes": upload, "broadcast_bytes": broadcast,
            "loss": float(np.mean(losses)) if losses else None,
            "round_s": round(time.perf_counter() - t_start, 6),
            "time_s": round(time.perf_counter() - self._t0, 6)})

    def _broadcast(self, msg_type: str, indices, values, model_size: int | None = None,
                   **fields) -> int:
        """Send one message to every worker; its wire bytes summed over workers.

        Encoded per worker: each connection's key cache knows different sets (a run in parts
        keeps one per connection and part); the index frame itself is encoded once.
        """
        ranks = sorted(self.members.active)
        part = fields.get("part")
        shared: dict = {}  # the index frame encoded once, one copy of the set for every cache
        messages = [protocol.encode(msg_type, indices, values,
                                    model_size=model_size or self.numel,
                                    cache=self.caches[r if part is None else (r, part)],
                                    shared=shared, **fields) for r in ranks]
        self._pace(sum(wire_bytes(m) for m in messages))
        return sum(self._send(self.members.rank_peer[r], m, it=fields.get("iter"))
                   for r, m in zip(ranks, messages))

    def _pace(self, nbytes: int) -> None:
        """With --bandwidth: hold the round as long as the server's link would need for nbytes.

        Pushes arrive (and broadcasts leave) as one block: on a real link the N flows share the
        server's bandwidth and all finish together, after N * size / rate. So every worker
        receives the broadcast at the same moment, as on a cluster, and the emulation matches
        psparse-model's additive form (compute + upload + broadcast).
        """
        if self.link is not None:
            self.link.occupy(nbytes)

    def _collect(self, it: int, msg_type: str) -> tuple[dict[int, protocol.Message], int]:
        """One ``msg_type`` message of iteration ``it`` from every rank, and their wire bytes."""
        got: dict[int, protocol.Message] = {}
        nbytes = self._gather(got, f"{msg_type} messages of iteration {it}", it, msg_type)
        return got, nbytes

    def _gather(self, got: dict, what: str, it: int | None, msg_type: str | None) -> int:
        """Receive until every active rank has an entry in ``got``.

        ``msg_type`` messages of iteration ``it`` go into ``got``; metrics are handled as they
        come (final reports land in ``self._finals``); a worker's error message loses that
        worker; anything else is rejected. Returns the wire bytes of the messages kept.
        """
        deadline = self._deadline()
        nbytes_total = 0
        members = self.members
        while members.active - set(got):
            missing = sorted(members.active - set(got))
            received = self._wait(f"{what} from ranks {missing}", deadline, missing, it)
            if received is None:  # a rank was lost (elastic): wait for the others only
                continue
            peer, frames, nbytes = received
            msg = self._accept(peer, frames)
            if msg is None or not self._wanted(peer, msg, what, it, msg_type):
                continue
            if msg["rank"] in got:
                self.reject(peer, ProtocolError(f"rank {msg['rank']} already sent {msg_type} "
                                                f"for iteration {it}"))
            else:
                try:
                    self._check_budget(msg, it)
                except ProtocolError as exc:  # not aggregated; the rank may send a valid one
                    self.reject(peer, exc)
                    continue
                got[msg["rank"]] = msg
                nbytes_total += nbytes
                if msg.indices is not None:
                    # the server only reads a push's indices: read-only, the cache holds them
                    # without a copy
                    msg.indices.flags.writeable = False
                    self.caches[msg["rank"]].remember(msg.indices, sent=False)
        return nbytes_total

    def _wanted(self, peer: bytes, msg: protocol.Message, what: str, it: int | None,
                msg_type: str | None) -> bool:
        """Whether an accepted message is a ``msg_type`` of iteration ``it`` (what the caller
        collects). Anything else is handled here: metrics are recorded, a worker's error loses
        it, other types and iterations are rejected."""
        if msg.type == "metrics":
            self._on_metrics(msg)
        elif msg.type == "error":  # the worker gives up and says why
            self.members.lose([self.members.peers[peer]], it, what, msg["message"])
            # elastic: the run goes on; acknowledge, so the worker can exit knowing its
            # cause is recorded (without --elastic, abort() tells everyone)
            self._try_send(peer, protocol.encode(
                "shutdown", ok=False, reason="dropped from the run: " + msg["message"]))
        elif msg_type is None or msg.type != msg_type:
            self.reject(peer, ProtocolError(f"unexpected {msg.type} message; the server "
                                            f"waits for {what}"))
        elif msg["iter"] != it:
            self.reject(peer, ProtocolError(f"{msg_type} for iteration {msg['iter']}, the "
                                            f"server is at iteration {it}"))
        elif (self.parts is not None) != ("part" in msg.header):
            self.reject(peer, ProtocolError(
                f"{msg_type} with a 'part' field, but this run is not exchanged in parts"
                if self.parts is None else
                f"this run is exchanged in parts: a {msg_type} must carry 'part'"))
        else:
            return True
        return False

    def _check_budget(self, msg: protocol.Message, it: int) -> None:
        """A push or proposal carries at most the cap the agreed run sets for this iteration;
        a dense push only where the cap makes dense the smaller form."""
        try:
            self.aggregator.check_budget(msg.type, it, protocol.step_at(self.run_description, it),
                                         msg["count"], msg.values if msg.get("dense") else None)
        except BudgetError as exc:
            raise ProtocolError(str(exc)) from None

    def vote(self, proposals: list[protocol.Message], it: int) -> tuple[np.ndarray, int]:
        """The indices a two-phase round keeps, and how many distinct indices were proposed."""
        keep = protocol.step_at(self.run_description, it)[1]  # the push cap: what the group keeps
        return self.aggregator.vote([m.indices for m in proposals],
                                    [m.values for m in proposals], keep)

    def aggregate(self, pushes: list[protocol.Message]) -> tuple[np.ndarray, np.ndarray]:
        """The pushes' mean at the union of their indices (a dense push covers every index)."""
        return self.aggregator.mean([None if m.get("dense") else m.indices for m in pushes],
                                    [m.values for m in pushes])

    def _check_checksums(self, it: int, checksums: dict[int, str | None]) -> None:
        reported = {r: c for r, c in checksums.items() if c is not None}
        if len(set(reported.values())) > 1:
            raise RunAborted(f"replicas diverged before iteration {it}: weight checksums " +
                             ", ".join(f"rank {r}={c}" for r, c in sorted(reported.items())))

    def _account(self, record: dict) -> None:
        t = self._totals
        t["upload_bytes"] += record["upload_bytes"]
        t["broadcast_bytes"] += record["broadcast_bytes"]
        t["union"].append(record["union"] / max(1, record["budget"]))
        t["train_s"] = record["time_s"]
        if record["loss"] is not None:
            t["loss"].append(record["loss"])
        if self._metrics_fh:
            self._metrics_fh.write(json.dumps(record) + "\n")
            self._metrics_fh.flush()

    # ---------------------------------------------------------------------- messages & ending
    def _accept(self, peer: bytes, frames) -> protocol.Message | None:
        """Decode and authenticate a message from a registered worker; None if rejected.

        Everything is validated first, whoever sent it, so a stranger's malformed message gets
        the same precise error as a worker's; then the sender must be a registered worker and
        may speak only for its own rank.
        """
        rank = self.members.peers.get(peer)
        try:
            # key cache: look sets up now, remember them only once accepted (docs/protocol.md)
            if self.parts is not None:
                msg = protocol.decode(frames, remember=False, scope=self._part_scope(rank))
            else:
                msg = protocol.decode(frames, numel=self.numel, remember=False,
                                      cache=self.caches[rank] if rank is not None else None)
            if msg.type == "heartbeat":
                self.members.heartbeat(msg)
                return None  # heartbeats are never answered
            self.members.sender(peer, msg)
            return msg
        except ProtocolError as exc:
            self.reject(peer, exc)
            return None

    def _on_metrics(self, msg: protocol.Message) -> None:
        values = msg["report"]
        record = {"iter": msg["iter"]}
        for key in EVAL_VALUES:
            v = values.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
                record[key] = v
        if values.get("final"):
            self._finals[msg["rank"]] = {"checksum": msg.get("checksum"), **record}
        # only the evaluator's results are the run's: another rank's cannot overwrite them
        if "test_acc" in record and msg["rank"] == self.members.evaluators[-1]["rank"]:
            record["time_s"] = round(time.perf_counter() - self._t0, 6)
            self._last_eval = record
            if self._eval_fh:
                self._eval_fh.write(json.dumps(record) + "\n")
                self._eval_fh.flush()

    def finish(self) -> None:
        """Wait for every worker's final report, verify replicas, write summary, stop workers."""
        self._gather(self._finals, "final reports", None, None)
        self._check_checksums(self.iterations,
                              {r: f["checksum"] for r, f in self._finals.items()})
        if self.limit is not None and self.out_dir:
            # what the limit still holds back: sent by no round yet, kept for inspection
            np.savez(self.out_dir / "server_residual.npz", indices=self.limit.support,
                     values=self.limit.residual[self.limit.support])
        self._write_summary("ok")
        self._broadcast_shutdown(True, "training complete")
        if self.sharded and self.run_dir:  # the last shard to finish writes the merged view
            keyranges.merge_run_dir(self.run_dir, self.shard[1])
        self.log(f"done: {self.iterations} iterations in "
                 f"{time.perf_counter() - self._t0:.1f} s")

    def abort(self, reason: str) -> None:
        self.log(f"error: {reason}")
        self._write_summary("failed", reason)
        self._broadcast_shutdown(False, reason)

    def _broadcast_shutdown(self, ok: bool, reason: str) -> None:
        frames = protocol.encode("shutdown", ok=ok, reason=reason)
        for rank in self.members.connected():
            self._try_send(self.members.rank_peer[rank], frames)

    def _try_send(self, peer: bytes, frames) -> None:
        try:
            self.channel.send(frames, peer)
        except (PeerGone, TransportTimeout):
            pass  # that peer is gone already; the others still hear about it

    def reject(self, peer: bytes, exc: Exception) -> None:
        """Answer a bad message with an error naming the problem; log the first few."""
        self.rejected += 1
        if self.rejected <= 20 or self.rejected % 1000 == 0:
            peers = self.members.peers
            who = f"rank {peers[peer]}" if peer in peers else "unregistered peer"
            self.log(f"rejected message #{self.rejected} from {who}: {exc}")
        try:
            self.channel.send(protocol.encode("error", message=str(exc)), peer)
        except (PeerGone, TransportTimeout):
            pass  # the peer is gone or not reading; nothing else to do for it

    def _send(self, peer: bytes, frames, it: int | None = None) -> int:
        """Send to a worker; one whose connection has closed is lost (dropped from an elastic
        run, else the run ends naming it). Returns the wire bytes (0 if not sent)."""
        rank = self.members.peers.get(peer)
        try:
            return self.channel.send(frames, peer)
        except PeerGone as exc:
            cause = f"its connection closed (a send to it failed: {exc})"
        except TransportTimeout as exc:
            cause = str(exc)
        self.members.lose([rank], it, "a send", cause)
        return 0

    def _write_summary(self, status: str, error: str | None = None) -> None:
        if not self.out_dir:
            return
        t = self._totals
        wall = time.perf_counter() - self._t0
        done = len(t["union"])
        dense_round = 2 * self.world_size * self.numel * 4  # float32 up and down, every worker
        summary = {
            "status": status,
            "error": error,
            "world_size": self.world_size,
            "numel": self.numel,
            "k": self.k,
            "iterations": done,
            "wall_s": round(wall, 3),
            "iterations_per_s": round(done / wall, 3) if wall > 0 and done else None,
            # training alone: to the last round's aggregate (wall_s also holds the final
            # evaluation and the end of the run, which make short runs look slower)
            "train_s": t.get("train_s"),
            "train_iterations_per_s": round(done / t["train_s"], 3)
            if done and t.get("train_s") else None,
            "union_over_k_mean": round(float(np.mean(t["union"])), 4) if done else None,
            "union_over_k_max": round(float(np.max(t["union"])), 4) if done else None,
            "pushed_k_mean": round(float(np.mean(t["pushed"])), 4) if t["pushed"] else None,
            "upload_mb": round(t["upload_bytes"] / 1e6, 4),
            "broadcast_mb": round(t["broadcast_bytes"] / 1e6, 4),
            "dense_mb": round(done * dense_round / 1e6, 4),
            "final_loss": t["loss"][-1] if t["loss"] else None,
            "test_acc": self._last_eval.get("test_acc") if self._last_eval else None,
            "test_loss": self._last_eval.get("test_loss") if self._last_eval else None,
            "rejected_messages": self.rejected,
            "lost_workers": self.members.lost,
            "evaluators": self.members.evaluators,
            "server_limit": None if self.limit is None else
            {"spec": "".join(str(x) for x in self.limit.spec), "held_back": int(
                self.limit.support.size)},
        }
        if self.sharded:
            summary["shard"] = list(self.shard)
            summary["key_range"] = list(self.key_range)
        write_json(self.out_dir / SUMMARY_FILE, summary)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psparse-server",
        description="Run the psparse parameter server for one training run: waits for "
                    "--workers workers to register, aggregates their sparse pushes every "
                    "iteration, and writes metrics.jsonl, eval.jsonl and summary.json to --out.")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; anything else is reachable "
                        "by other hosts and prints a warning)")
    p.add_argument("--port", type=int, default=5555,
                   help="TCP port (default 5555; 0 picks a free one, written to OUT/server.port)")
    p.add_argument("--out", type=Path, default=None, help="run directory for metrics files")
    p.add_argument("--world-size", type=int, dest="workers", default=None,
                   help="alias of --workers")
    add_config_arguments(p, only=SERVER_CONFIG)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="admit only workers that prove this secret in their register (HMAC; "
                        "default: $PSPARSE_TOKEN; none: any peer that reaches the port may "
                        "register). psparse-launch generates one per run")
    p.add_argument("--shard", default="0/1", metavar="I/S",
                   help="serve key range I of S (0-based; default 0/1, the whole model): "
                        "[I*numel//S, (I+1)*numel//S) of the flat parameter vector, files in "
                        "OUT/shard-I/; start one server per shard and give the workers every "
                        "shard's address, in order (docs/protocol.md, Server shards)")
    return p


def main(argv=None) -> int:
    args, cfg = parse_with_config(build_parser(), argv)
    run_token = args.run_token or os.environ.get("PSPARSE_TOKEN") or None
    try:
        shard = keyranges.parse_shard(args.shard)
        if shard[1] > 1:
            keyranges.check_shardable(cfg)
    except ValueError as exc:
        build_parser().error(str(exc))
    if not is_loopback(args.bind) and not cfg.curve_keys:
        warn(f"binding {args.bind}: traffic is not encrypted and "
             + ("only the run token guards admission" if run_token else
                "the server accepts workers from any host that reaches this port (no "
                "authentication; use --curve-keys, or at least --run-token)"))
    try:
        server = Server(cfg.workers, bind=args.bind, port=args.port, out_dir=args.out,
                        timeout=cfg.timeout, max_message_bytes=int(cfg.max_message_mb * 1e6),
                        limit=cfg.server_limit, curve_keys=cfg.curve_keys,
                        elastic=cfg.elastic, register_timeout=cfg.register_timeout,
                        checkpoint_every=cfg.checkpoint_every, resume=args.resume,
                        device=cfg.server_device, run_token=run_token, shard=shard)
        if cfg.bandwidth:
            server.link = Pacer(parse_rate(cfg.bandwidth))
    except (OSError, ValueError) as exc:
        print(f"psparse-server: error: {exc}", file=sys.stderr)
        return 1
    def on_term(signum, frame):  # the launcher stops us: still leave a summary behind
        raise RunAborted(f"terminated by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return server.run()
    except ValueError as exc:  # e.g. --resume without a usable checkpoint
        print(f"psparse-server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
