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
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import numpy as np

from . import checkpoint, protocol
from .codec import KeyCache
from .config import add_config_arguments, parse_limit, parse_with_config
from .kernels import sorted_union, sparse_mean
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
from .sparsify import topk_exact
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
from .xp import cupy_or_none, to_host


class RunAborted(RuntimeError):
    """The run cannot go on (timeout, disagreement, diverged replicas); the text says why."""


class Server:
    def __init__(self, world_size: int, *, bind: str = "127.0.0.1", port: int = 0,
                 out_dir: str | Path | None = None, timeout: float = 60.0,
                 max_message_bytes: int = 1 << 30, limit: str | None = None,
                 curve_keys: str | None = None, elastic: bool = False,
                 register_timeout: float = 120.0, checkpoint_every: int = 0,
                 resume: bool = False, device: str = "cpu", run_token: str | None = None,
                 log=None):
        self.world_size = world_size
        self.run_token = run_token or None  # a register must prove it (HMAC), when set
        self._nonces: set[str] = set()  # register nonces seen: a replayed register is refused
        self.xp = np
        if device == "cuda":  # sum the pushes on the GPU (kernels.sparse_mean with CuPy)
            self.xp = cupy_or_none()
            if self.xp is None:
                raise ValueError("--server-device cuda: no CUDA device, or CuPy is not installed")
        self.checkpoint_every = checkpoint_every
        self.start = 0  # first iteration to serve (> 0 when resuming)
        self.resume = resume
        self.register_timeout = register_timeout
        self.elastic = elastic
        self.heartbeat_s = timeout / 5  # several beats fit in one timeout
        self.patience = 10  # a wait ends after 10 x timeout even if everyone heartbeats
        self._last_heartbeat = 0.0
        self._wait_start = time.monotonic()
        self.active: set[int] = set(range(world_size))
        self.lost: list[dict] = []
        self.last_seen: dict[int, float] = {}
        self.tokens: dict[int, str] = {}
        self.limit_spec = parse_limit(limit) if limit else None
        self.link: Pacer | None = None  # --bandwidth emulation of the server's link
        self.limit: ServerLimit | None = None
        self.timeout = timeout
        self.channel = Channel.server(bind, port, max_message_bytes=max_message_bytes,
                                      send_timeout_s=timeout, curve_keys=curve_keys)
        self.out_dir = Path(out_dir) if out_dir else None
        self.log = log or (lambda msg: print(f"[server] {msg}", file=sys.stderr, flush=True))
        self.peers: dict[bytes, int] = {}  # routing id -> rank
        self.rank_peer: dict[int, bytes] = {}
        self.numel = 0
        self.iterations = 0
        self.rejected = 0
        self._metrics_fh = self._eval_fh = None
        self._finals: dict[int, dict] = {}
        self._last_eval: dict | None = None
        self.k = 0
        self.run_description: dict | None = None  # the agreed run, from the registrations
        self.training = False  # registration is over; ranks can no longer be rebound
        self._registrations: dict[int, protocol.Message] = {}
        self.evaluators = [{"rank": 0, "from_iter": 0}]  # moves on if an elastic run loses 0
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
        elif self.resume:
            raise ValueError("resuming needs the run directory (--out)")
        self.log(f"listening on port {self.port} for {self.world_size} workers")
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
        while True:
            now = time.monotonic()
            lost = [r for r in waiting_for if r in self.active
                    and now - self.last_seen.get(r, now) > self.timeout]
            if lost:
                self._lose(lost, it, what)
                return None
            if now >= deadline:
                raise RunAborted(f"timed out after {deadline - self._wait_start:.0f} s waiting "
                                 f"for {what}")
            if self.heartbeat_s and now - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = now  # tell waiting workers the server is alive
                beat = protocol.encode("heartbeat")
                gone = []
                for r in sorted(self.active & set(self.rank_peer)):
                    try:
                        self.channel.send(beat, self.rank_peer[r])
                    except PeerGone:  # ROUTER_MANDATORY: this peer's connection closed
                        if self.training:
                            gone.append(r)
                        else:  # registered, then left: free the rank
                            self._unbind(r, "its connection closed")
                    except TransportTimeout:
                        pass  # connected but not reading: silence decides, above
                if gone:
                    self._lose(gone, it, what, "its connection closed (the worker has gone)")
                    return None
            step = min(deadline - now, self.heartbeat_s or deadline - now, 0.5)
            got = self.channel.recv(max(step, 0.0))
            if got is not None:
                rank = self.peers.get(got[0])
                if rank is not None:
                    self.last_seen[rank] = time.monotonic()
                return got

    # ---------------------------------------------------------------------- checkpoint, resume
    def _resume_point(self) -> int:
        it = checkpoint.latest_common(self.out_dir, self.world_size)
        if it is None:
            raise ValueError(f"no checkpoint in {self.out_dir} that the server and all "
                             f"{self.world_size} workers saved")
        self.start = it
        return it

    def _checkpoint(self, iteration: int) -> None:
        checkpoint.save(self.out_dir, "server", iteration, {
            "iteration": iteration,
            "totals": self._totals, "rejected": self.rejected, "last_eval": self._last_eval,
            "active": sorted(self.active), "lost": self.lost, "evaluators": self.evaluators,
            "caches": {r: c.state() for r, c in self.caches.items()},
            "limit": None if self.limit is None else
            {"support": self.limit.support, "values": self.limit.residual[self.limit.support]},
            "elapsed": time.perf_counter() - self._t0,
        })

    def _restore(self) -> None:
        state = checkpoint.load(self.out_dir, "server", self.start)
        self._totals, self.rejected = state["totals"], state["rejected"]
        self._totals.setdefault("pushed", [])
        self.evaluators = state.get("evaluators", self.evaluators)
        self._last_eval, self.lost = state["last_eval"], state["lost"]
        self.active = set(state["active"])
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

    def _lose(self, ranks: list[int], it: int | None, what: str,
              error: str | None = None) -> None:
        where = f"at iteration {it}" if it is not None else "after the last iteration"
        names = ", ".join(str(r) for r in ranks)
        if not self.elastic or len(self.active) - len(ranks) < 1:
            if error:
                raise RunAborted(f"rank {names} failed {where}: {error}")
            raise RunAborted(f"rank {names} stopped answering {where} (nothing for "
                             f"{self.timeout:g} s while waiting for {what})")
        evaluator = min(self.active)
        self.active -= set(ranks)
        self.lost += [{"rank": r, "iter": it} for r in ranks]
        self.log(f"elastic: lost rank {names} {where}; continuing with "
                 f"{len(self.active)} workers")
        if evaluator in ranks:  # the lowest live rank evaluates from this iteration's end on
            self.evaluators.append({"rank": min(self.active),
                                    "from_iter": self.iterations if it is None else it})
            self.log(f"elastic: rank {min(self.active)} evaluates from iteration "
                     f"{self.evaluators[-1]['from_iter']} on")

    # -------------------------------------------------------------------------- registration
    def register_workers(self) -> None:
        self._wait_start = time.monotonic()
        deadline = self._wait_start + self.register_timeout
        self._registrations: dict[int, protocol.Message] = {}
        while True:
            regs = self._registrations
            if len(regs) == self.world_size:
                # every rank is bound: make sure no bound peer left meanwhile, then start
                for rank in sorted(regs):
                    if not self._reachable(self.rank_peer[rank]):
                        self._unbind(rank, "its connection closed")
                if len(regs) == self.world_size:
                    break
            missing = sorted(set(range(self.world_size)) - set(regs))
            peer, frames, _ = self._wait(f"workers to register (missing ranks {missing})",
                                         deadline)
            try:
                msg, rank = self._admit(peer, frames)
            except ProtocolError as exc:
                self.reject(peer, exc)
                continue
            regs[rank] = msg
            self.peers[peer], self.rank_peer[rank] = rank, peer
        self._agree(regs)
        run = self.run_description
        self.numel, self.iterations = run["numel"], run["iterations"]
        self.two_phase = run["two_phase"]
        self.k = run["steps"][-1][1]  # the configured k (density x numel), the unit of union/k
        # The only model-sized buffer: pushes are summed into it, then the touched entries are
        # read out and zeroed again, so no round allocates or clears numel floats.
        self.accumulator = self.xp.zeros(self.numel, dtype=self.xp.float32)
        self._dense_out = np.empty(self.numel, dtype=np.float32)  # for dense broadcasts
        self._all_indices = None
        self.index_dtype = protocol.index_dtype_for(self.numel)
        self.limit = ServerLimit(self.numel, self.limit_spec) if self.limit_spec else None
        # per worker: the index sets both ends of that connection hold (protocol key caching)
        self.caches = {r: KeyCache() for r in range(self.world_size)}
        self.active = set(range(self.world_size))
        self.tokens = {r: secrets.token_hex(8) for r in range(self.world_size)}
        self.last_seen = {r: time.monotonic() for r in range(self.world_size)}
        self.training = True
        for rank in range(self.world_size):
            self._send(self.rank_peer[rank], protocol.encode(
                "ready", world_size=self.world_size, start=self.start, run=run,
                token=self.tokens[rank], heartbeat_s=self.heartbeat_s), it=self.start)
        self.log(f"{self.world_size} workers registered: numel={self.numel}, "
                 f"iterations={self.iterations}")
        self._t0 = time.perf_counter()

    def _admit(self, peer: bytes, frames) -> tuple[protocol.Message, int]:
        """A valid register that proves the run token, for a rank this peer may take."""
        msg = protocol.decode(frames)
        if msg.type != "register":
            raise ProtocolError(f"expected register before training starts, got {msg.type}")
        rank = msg["rank"]
        if msg["world_size"] != self.world_size:
            raise ProtocolError(f"world_size {msg['world_size']} does not match the server's "
                                f"{self.world_size}")
        if rank >= self.world_size:
            raise ProtocolError(f"rank {rank} out of range [0, {self.world_size})")
        if self.run_token is not None:
            if not protocol.proof_is_valid(self.run_token, msg.header):
                raise ProtocolError("register does not prove the run token (fields nonce and "
                                    "proof; docs/protocol.md, Admission)")
            if msg["nonce"] in self._nonces:
                raise ProtocolError("register nonce already used (a replayed register)")
            self._nonces.add(msg["nonce"])
        if "run" in msg.header:
            protocol.check_run(msg["run"])
        if peer in self.peers and self.peers[peer] != rank:
            raise ProtocolError(f"this peer already registered as rank {self.peers[peer]}")
        if rank in self.rank_peer and self.rank_peer[rank] != peer:
            if self._reachable(self.rank_peer[rank]):
                raise ProtocolError(f"rank {rank} is already registered by another peer that "
                                    "is still connected")
            self._unbind(rank, "its connection closed; the rank goes to the new peer")
        return msg, rank

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

    def _unbind(self, rank: int, why: str) -> None:
        """Free a rank whose peer registered and left before training: another may take it."""
        peer = self.rank_peer.pop(rank, None)
        self.peers.pop(peer, None)
        self._registrations.pop(rank, None)
        self.log(f"rank {rank} is free again: the peer that registered it left ({why})")

    def _agree(self, regs: dict[int, protocol.Message]) -> None:
        """All registrations describe the same run, or the run cannot start."""
        for r, m in regs.items():
            if m.get("start", 0) != self.start:
                raise RunAborted(f"rank {r} resumes at iteration {m.get('start', 0)}, the server "
                                 f"at {self.start}")
        described = {r: m["run"] for r, m in sorted(regs.items()) if "run" in m.header}
        if not described:
            raise RunAborted("no worker described the run (every register lacks 'run')")
        first, reference = next(iter(described.items()))
        for r, run in described.items():
            field = protocol.run_difference(reference, run)
            if field is not None:
                mine, theirs = _lookup(reference, field), _lookup(run, field)
                if isinstance(mine, list) and isinstance(theirs, list):  # e.g. config.layers
                    at = next((i for i, (x, y) in enumerate(zip(mine, theirs))
                               if not protocol.same_value(x, y)), min(len(mine), len(theirs)))
                    mine, theirs = _item(mine, at), _item(theirs, at)
                    field = f"{field}[{at}]"
                raise RunAborted(f"workers disagree on {field}: rank {first}={mine!r}, "
                                 f"rank {r}={theirs!r}")
        # workers that omit the checksum opt out of replica comparison (docs/protocol.md)
        checksums = {r: m["checksum"] for r, m in sorted(regs.items()) if "checksum" in m.header}
        if len(set(checksums.values())) > 1:
            raise RunAborted("workers disagree on checksum (initial weights): " +
                             ", ".join(f"rank {r}={c}" for r, c in checksums.items()))
        self.run_description = reference

    # --------------------------------------------------------------------------------- rounds
    def serve_round(self, it: int) -> None:
        t_start = time.perf_counter()
        upload = broadcast = 0
        proposed = None
        if self.two_phase:
            # Phase 1: every worker proposes entries (possibly none); the group keeps the
            # `select` indices of largest mean |value| and every worker pushes there.
            proposals, upload = self._collect(it, "propose")
            self._pace(upload)
            chosen, proposed = self.vote([proposals[r] for r in sorted(proposals)], it)
            broadcast += self._broadcast("indices", chosen.astype(self.index_dtype, copy=False),
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
            sent_idx, sent_val = self.limit.apply(union, mean,
                                                  self.limit.entries(budget, len(ranks)))
        dense = protocol.dense_is_smaller(sent_idx.size, self.numel, self.index_dtype)
        # after a loss in an elastic run every aggregate names the ranks still in the run
        live = {"live": sorted(self.active)} if len(self.active) < self.world_size else {}
        if dense:
            self._dense_out[:] = 0.0
            self._dense_out[sent_idx] = sent_val
            broadcast += self._broadcast("aggregate", None, self._dense_out, iter=it,
                                         workers=len(ranks), dense=True, **live)
        else:
            broadcast += self._broadcast("aggregate",
                                         sent_idx.astype(self.index_dtype, copy=False),
                                         sent_val, iter=it, workers=len(ranks), **live)
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

    def _broadcast(self, msg_type: str, indices, values, **fields) -> int:
        """Send one message to every worker; its wire bytes summed over workers.

        Encoded per worker: each connection's key cache knows different sets.
        """
        ranks = sorted(self.active)
        messages = [protocol.encode(msg_type, indices, values, model_size=self.numel,
                                    cache=self.caches[r], **fields) for r in ranks]
        self._pace(sum(wire_bytes(m) for m in messages))
        return sum(self._send(self.rank_peer[r], m, it=fields.get("iter"))
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
        while self.active - set(got):
            missing = sorted(self.active - set(got))
            received = self._wait(f"{what} from ranks {missing}", deadline, missing, it)
            if received is None:  # a rank was lost (elastic): wait for the others only
                continue
            peer, frames, nbytes = received
            msg = self._accept(peer, frames)
            if msg is None:
                continue
            if msg.type == "metrics":
                self._on_metrics(msg)
            elif msg.type == "error":  # the worker gives up and says why
                self._lose([self.peers[peer]], it, what, msg["message"])
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
            elif msg["rank"] in got:
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
                    self.caches[msg["rank"]].remember(msg.indices, sent=False)
        return nbytes_total

    def _check_budget(self, msg: protocol.Message, it: int) -> None:
        """A push or proposal carries at most the cap the agreed run sets for this iteration;
        a dense push only where the cap makes dense the smaller form."""
        _, push_max, propose_max = protocol.step_at(self.run_description, it)
        if msg.get("dense"):
            if not protocol.dense_is_smaller(push_max, self.numel, self.index_dtype):
                raise ProtocolError(f"dense push refused: the push cap at iteration {it} is "
                                    f"{push_max} of {self.numel} entries, which go sparse")
            count = int(np.count_nonzero(msg.values))
            if count > push_max:
                raise ProtocolError(f"dense push has {count} nonzero entries, more than the "
                                    f"push cap of {push_max} at iteration {it}")
            return
        cap = propose_max if msg.type == "propose" else push_max
        if msg["count"] > cap:
            raise ProtocolError(f"{msg.type} has {msg['count']} entries, more than the cap of "
                                f"{cap} at iteration {it} (agreed run, step "
                                f"{list(protocol.step_at(self.run_description, it))})")

    def vote(self, proposals: list[protocol.Message], it: int) -> tuple[np.ndarray, int]:
        """The indices a two-phase round keeps, and how many distinct indices were proposed."""
        union, mean_abs = (to_host(a) for a in sparse_mean(
            self.accumulator, [m.indices for m in proposals],
            [np.abs(m.values) for m in proposals]))
        keep = protocol.step_at(self.run_description, it)[1]  # the push cap: what the group keeps
        if keep >= union.size:
            return union, int(union.size)
        return union[topk_exact(mean_abs, keep)], int(union.size)

    def aggregate(self, pushes: list[protocol.Message]) -> tuple[np.ndarray, np.ndarray]:
        # a dense push covers every index
        union, mean = sparse_mean(self.accumulator,
                                  [self.all_indices if m.get("dense") else m.indices
                                   for m in pushes], [m.values for m in pushes])
        return to_host(union), to_host(mean)

    @property
    def all_indices(self) -> np.ndarray:
        if self._all_indices is None:
            self._all_indices = np.arange(self.numel, dtype=np.int64)
        return self._all_indices

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
        rank = self.peers.get(peer)
        try:
            # key cache: look sets up now, remember them only once accepted (docs/protocol.md)
            msg = protocol.decode(frames, numel=self.numel, remember=False,
                                  cache=self.caches[rank] if rank is not None else None)
            if msg.type == "heartbeat":
                beat = msg.get("rank")
                if beat is None or self.tokens.get(beat) != msg.get("token"):
                    raise ProtocolError("heartbeat with an unknown rank or token")
                if beat in self.active:
                    self.last_seen[beat] = time.monotonic()
                return None  # heartbeats are never answered
            if rank is None:
                raise ProtocolError("peer is not a registered worker of this run")
            if rank not in self.active:
                raise ProtocolError(f"rank {rank} was dropped from this (elastic) run")
            if msg.type == "register":
                raise ProtocolError("training has started; register is no longer accepted")
            if "rank" in msg.header and msg["rank"] != rank:
                raise ProtocolError(f"peer registered as rank {rank} cannot send for rank "
                                    f"{msg['rank']}")
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
        if "test_acc" in record:
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
        self.log(f"done: {self.iterations} iterations in "
                 f"{time.perf_counter() - self._t0:.1f} s")

    def abort(self, reason: str) -> None:
        self.log(f"error: {reason}")
        self._write_summary("failed", reason)
        self._broadcast_shutdown(False, reason)

    def _broadcast_shutdown(self, ok: bool, reason: str) -> None:
        frames = protocol.encode("shutdown", ok=ok, reason=reason)
        for rank in sorted(self.active & set(self.rank_peer)):
            self._try_send(self.rank_peer[rank], frames)

    def _try_send(self, peer: bytes, frames) -> None:
        try:
            self.channel.send(frames, peer)
        except (PeerGone, TransportTimeout):
            pass  # that peer is gone already; the others still hear about it

    def reject(self, peer: bytes, exc: Exception) -> None:
        """Answer a bad message with an error naming the problem; log the first few."""
        self.rejected += 1
        if self.rejected <= 20 or self.rejected % 1000 == 0:
            who = f"rank {self.peers[peer]}" if peer in self.peers else "unregistered peer"
            self.log(f"rejected message #{self.rejected} from {who}: {exc}")
        try:
            self.channel.send(protocol.encode("error", message=str(exc)), peer)
        except (PeerGone, TransportTimeout):
            pass  # the peer is gone or not reading; nothing else to do for it

    def _send(self, peer: bytes, frames, it: int | None = None) -> int:
        """Send to a worker; one whose connection has closed is lost (dropped from an elastic
        run, else the run ends naming it). Returns the wire bytes (0 if not sent)."""
        rank = self.peers.get(peer)
        try:
            return self.channel.send(frames, peer)
        except PeerGone as exc:
            cause = f"its connection closed (a send to it failed: {exc})"
        except TransportTimeout as exc:
            cause = str(exc)
        self._lose([rank], it, "a send", cause)
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
            "lost_workers": self.lost,
            "evaluators": self.evaluators,
            "server_limit": None if self.limit is None else
            {"spec": "".join(str(x) for x in self.limit.spec), "held_back": int(
                self.limit.support.size)},
        }
        write_json(self.out_dir / SUMMARY_FILE, summary)


class ServerLimit:
    """A cap on the entries broadcast per round that loses nothing.

    When the round's aggregate (plus what earlier rounds held back) has more than L entries, the
    L of largest |value| are broadcast and the rest stays in a server-side residual that is
    added to the next round's aggregate -- gTop-k returns its cut to residuals for the same
    reason. Invariant: sum over rounds of the pushes' mean = sum of broadcasts + residual.
    """

    def __init__(self, numel: int, spec: tuple[float, str]):
        self.spec = spec
        self.residual = np.zeros(numel, dtype=np.float32)  # in aggregate (mean) units
        self.support = np.empty(0, dtype=np.int64)  # sorted indices where residual != 0

    def entries(self, k: int, world_size: int) -> int:
        mult, unit = self.spec
        if unit == "entries":
            return int(mult)
        if unit == "Nk":
            return world_size * k
        return max(1, int(round(mult * k)))

    def apply(self, union: np.ndarray, mean: np.ndarray,
              limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) to broadcast; the residual keeps the rest."""
        if self.support.size == 0 and union.size <= limit:
            return union, mean
        candidates = sorted_union([union, self.support])
        values = self.residual[candidates]  # fancy indexing: a copy
        values[np.searchsorted(candidates, union)] += mean
        self.residual[self.support] = 0.0
        if candidates.size <= limit:
            self.support = np.empty(0, dtype=np.int64)
            return candidates, values
        keep = topk_exact(values, limit)
        held = np.ones(candidates.size, dtype=bool)
        held[keep] = False
        self.support = candidates[held]
        self.residual[self.support] = values[held]
        return candidates[keep], values[keep]


def _item(values: list, at: int):
    return values[at] if at < len(values) else "(none: the list ends)"


def _lookup(run: dict, field: str):
    """A run map's value at "numel" or "config.lr"."""
    for part in field.split("."):
        run = run.get(part) if isinstance(run, dict) else None
    return run


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
    add_config_arguments(p, only=("workers", "timeout", "max_message_mb", "server_limit",
                                  "server_device",
                                  "bandwidth", "curve_keys", "elastic", "register_timeout",
                                  "checkpoint_every"))
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="admit only workers that prove this secret in their register (HMAC; "
                        "default: $PSPARSE_TOKEN; none: any peer that reaches the port may "
                        "register). psparse-launch generates one per run")
    return p


def main(argv=None) -> int:
    args, cfg = parse_with_config(build_parser(), argv)
    run_token = args.run_token or os.environ.get("PSPARSE_TOKEN") or None
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
                        device=cfg.server_device, run_token=run_token)
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
