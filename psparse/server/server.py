"""The parameter server's run: registration, the rounds, the end (and checkpoints between).

One ROUTER socket (``Endpoint``). Phase 1: wait for N workers to register (each proving the run
token when the server has one; a rank is bound to the first peer that proves it, and freed again
if that peer leaves before training) and check they agree on the run (docs/protocol.md, "The
run"). Phase 2: serve every iteration (``Rounds``). Phase 3: collect every worker's final
checksum, write summary.json (``Records``), tell the workers to stop.

Every wait is bounded by ``timeout``; a bad message is answered with an ``error`` message and
otherwise ignored, so a misbehaving peer cannot stop or corrupt the run of well-behaved workers.

With ``shard=(I, S)`` the server is one of S key-range shards (psparse/wire/keyranges.py): it serves
keys [I*numel//S, (I+1)*numel//S) in shard-relative indices, answers proposals with
``candidates`` instead of ``indices``, and keeps its files in RUN_DIR/shard-I/; the last shard
to finish merges the run's files.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .. import checkpoint
from ..ops import jit
from ..option_rules import bucket_refusal, parse_limit
from ..rundir import PORT_FILE, SUMMARY_FILE, RunDirError, write_atomic
from ..wire import keyranges, protocol, run_description
from ..wire.protocol import ProtocolError
from ..wire.transport import Channel
from .aggregation import Aggregator, BroadcastMemory, ServerLimit, array_module_for
from .endpoint import Endpoint
from .membership import Membership, RunAborted
from .records import Records, merge_run_dir
from .rounds import Rounds, RunClosed, check_checksums


class Server:
    def __init__(self, world_size: int, *, bind: str = "127.0.0.1", port: int = 0,
                 out_dir: str | Path | None = None, timeout: float = 60.0,
                 max_message_bytes: int = 1 << 30, limit: str | None = None,
                 curve_keys: str | None = None, elastic: bool = False,
                 register_timeout: float = 120.0, checkpoint_every: int = 0,
                 resume: bool = False, device: str = "cpu", run_token: str | None = None,
                 shard: tuple[int, int] = (0, 1), log=None):
        self.world_size = world_size
        # key-range shard I of S (psparse/wire/keyranges.py): this server holds [lo, hi) of the flat
        # vector, speaks in shard-relative indices, and keeps its files in RUN_DIR/shard-I/
        self.shard = shard
        self.sharded = shard[1] > 1
        self.key_range = (0, 0)
        self.dev = array_module_for(device)  # cuda: sum the pushes on the GPU (a backend)
        self.checkpoint_every = checkpoint_every
        self.start = 0  # first iteration to serve (> 0 when resuming)
        self.resume = resume
        self.register_timeout = register_timeout
        self.limit_spec = parse_limit(limit) if limit else None
        self.limit: ServerLimit | None = None
        self.value_memory: BroadcastMemory | None = None  # --values: the broadcast's error
        self.run_dir = Path(out_dir) if out_dir else None
        self.out_dir = keyranges.shard_dir(self.run_dir, shard[0]) \
            if self.run_dir and self.sharded else self.run_dir  # this server's own files
        name = f"server {shard[0]}/{shard[1]}" if self.sharded else "server"
        self.log = log or (lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
        self.records = Records(self.out_dir)
        channel = Channel.server(bind, port, max_message_bytes=max_message_bytes,
                                 send_timeout_s=timeout, curve_keys=curve_keys)
        # who is in the run; it probes a peer's connection through the server's socket
        self.members = Membership(world_size, reachable=lambda peer: self.endpoint.reachable(peer),
                                  run_token=run_token, timeout=timeout, elastic=elastic,
                                  log=self.log)
        self.endpoint = Endpoint(channel, self.members, timeout=timeout, log=self.log,
                                 records=self.records)
        self.rounds: Rounds | None = None  # from registration on (the agreed run is known)
        self.numel = self.iterations = self.k = 0  # iterations 0: open-ended (stop ends it)
        self.end = 0  # the iterations served, once the rounds are over
        self.ended: str | None = None  # why they are over (summary.json's "ended")
        self.run_description: dict | None = None  # the agreed run, from the registrations

    @property
    def port(self) -> int:
        return self.endpoint.port

    @property
    def link(self):
        return self.endpoint.link

    @link.setter
    def link(self, pacer) -> None:  # --bandwidth emulation of the server's link
        self.endpoint.link = pacer

    @property
    def rejected(self) -> int:
        return self.records.rejected

    # ------------------------------------------------------------------------------- main loop
    def run(self) -> int:
        """Serve one training run; returns the process exit code (0 ok, 1 aborted)."""
        if self.resume and not self.out_dir:
            raise ValueError("resuming needs the run directory (--out)")
        try:
            if self.out_dir:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                saved = self._resume_point() if self.resume else None
                self.records.open(saved)
                write_atomic(self.out_dir / PORT_FILE, f"{self.port}\n")
                if self.sharded:  # the merge waits for every shard's summary of this run
                    (self.out_dir / SUMMARY_FILE).unlink(missing_ok=True)
            self.log(f"listening on port {self.port} for {self.world_size} workers"
                     + (f" (key-range shard {self.shard[0]} of {self.shard[1]})"
                        if self.sharded else ""))
            self.register_workers()
            if self.resume:
                self._restore()
            self.serve_rounds()
            self.finish()
            return 0
        except RunAborted as exc:
            self.abort(str(exc), exc.ranks)
            return 1
        except (RunDirError, checkpoint.CheckpointError) as exc:  # the run directory's files
            self.abort(str(exc))
            return 1
        except Exception as exc:  # a bug: still tell every worker and leave the cause on record
            self.log(traceback.format_exc().rstrip())
            self.abort(f"the server failed: {type(exc).__name__}: {exc} (a bug in "
                       "psparse-server; its log has the traceback)")
            return 1
        finally:
            self.records.close()
            self.endpoint.channel.close()

    def serve_rounds(self) -> None:
        """Every round of the run: up to its ``iterations`` or, sooner (and in an open-ended
        run, ``iterations`` 0, only so), through the round a rank's push asked to stop."""
        it = self.start
        while self.iterations == 0 or it < self.iterations:
            try:
                stoppers = self.rounds.serve(it)
            except RunClosed:  # every rank closed after the last round (open-ended runs)
                self.ended = (f"closed by every rank after iteration {it - 1}" if it
                              else "closed by every rank before iteration 0")
                break
            it += 1
            if stoppers:
                self.ended = (f"stopped by rank{'s' if len(stoppers) > 1 else ''} "
                              f"{', '.join(map(str, stoppers))} at iteration {it - 1}")
                break
            if self.checkpoint_every and it % self.checkpoint_every == 0 \
                    and (self.iterations == 0 or it < self.iterations):
                self._checkpoint(it)
        else:
            self.ended = "iterations reached"
        self.end = self.members.iterations = it  # (an elastic hand-over after the end names it)
        self.log(f"{self.ended}; waiting for the final reports")

    # -------------------------------------------------------------------------- registration
    def register_workers(self) -> None:
        endpoint, members = self.endpoint, self.members
        endpoint.wait_start = time.monotonic()
        deadline = endpoint.wait_start + self.register_timeout
        while not members.complete():  # every rank bound to a peer that is still there
            peer, frames, _ = endpoint.wait(
                f"workers to register (missing ranks {members.missing()}; a worker started "
                "alone compiles its CPU kernels first when numba's cache lacks them, which can "
                "take minutes on a slow host: raise --register-timeout)", deadline)
            try:
                msg = protocol.decode(frames)
                if msg.type == "error":  # a worker that cannot start: the run cannot either
                    reason = members.failed_before_training(peer, msg)
                    endpoint.try_send(peer, protocol.encode("shutdown", ok=False, reason=reason))
                    raise RunAborted(reason)
                self._check_shard(msg)
                members.register(peer, msg)
            except ProtocolError as exc:
                endpoint.reject(peer, exc)
        self.run_description = run = members.agree(self.start)
        try:
            given = run.get("shard_edges")  # the workers' --shard-edges: [0, E1, ..., numel]
            edges = keyranges.bounds(run["numel"], self.shard[1],
                                     None if given is None else given[1:-1])
        except ValueError as exc:
            raise RunAborted(str(exc)) from None
        self.key_range = (int(edges[self.shard[0]]), int(edges[self.shard[0] + 1]))
        # a shard's messages index its own range: the model it serves has hi - lo entries
        self.numel = self.key_range[1] - self.key_range[0]
        self.iterations = run["iterations"]
        self.k = run["steps"][-1][1]  # the configured k (density x numel), the unit of union/k
        self.limit = ServerLimit(self.numel, self.limit_spec) if self.limit_spec else None
        value_format, keep = run_description.run_value_format(run)  # --values
        if not value_format.exact:
            self.value_memory = BroadcastMemory(self.numel, value_format, keep)
        # a round in parts (buckets of layers, docs/protocol.md "Parts"): part p holds keys
        # [parts[p], parts[p + 1]) and is aggregated and broadcast as soon as every rank pushed it
        parts = run.get("parts")
        if parts is not None:
            why = bucket_refusal(two_phase=run["two_phase"], server_limit=self.limit is not None,
                                 elastic=members.elastic, shards=self.sharded)
            if why is not None:
                raise RunAborted("the run is exchanged in parts (buckets, --overlap / "
                                 "--bucket-mb), which " + why.replace(" {policy}", ""))
        spans = [(0, self.numel)] if parts is None else list(zip(parts, parts[1:]))
        endpoint.configure(self.numel, parts, self.world_size)
        self.rounds = Rounds(endpoint=endpoint, records=self.records, members=members, run=run,
                             aggregators=[Aggregator(hi - lo, self.dev, value_format)
                                          for lo, hi in spans],
                             parts=parts, limit=self.limit, shard=self.shard,
                             value_memory=self.value_memory, first_key=self.key_range[0])
        members.start_training(self.iterations)
        # the sums and the codec's kernels, before any worker is told to start (round 1 on a
        # host with a sixth of a core would otherwise pay seconds for them)
        jit.preload(("agg_kernels", "codec_kernels")
                    + (("value_kernels",) if self.value_memory is not None else ()),
                    self.numel, self.log)
        for rank in sorted(members.expected):
            endpoint.send(members.rank_peer[rank], protocol.encode(
                "ready", world_size=self.world_size, start=self.start, run=run,
                token=members.tokens[rank], heartbeat_s=endpoint.heartbeat_s), it=self.start)
        self.log(f"{len(members.expected)} workers registered: numel={self.numel}, "
                 f"iterations={self.iterations}"
                 + (f", keys [{self.key_range[0]}, {self.key_range[1]}) of {run['numel']}"
                    if self.sharded else ""))
        self.records.t0 = time.perf_counter()

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

    # ---------------------------------------------------------------------- checkpoint, resume
    def _resume_point(self) -> int:
        """The iteration to resume at; registration then expects exactly the ranks live at it
        (an elastic run that lost workers before it resumes without them)."""
        point = checkpoint.resume_point(self.run_dir, self.world_size, self.shard[1])
        if point is None:
            raise RunAborted(f"no checkpoint in {self.run_dir} that the server"
                             + (f" shards (all {self.shard[1]})" if self.sharded else "")
                             + " and every worker live at it saved")
        self.start = point.iteration
        self.members.expect(point.live)
        if len(point.live) < self.world_size:
            self.log(f"resuming at iteration {point.iteration} with the ranks live then: "
                     f"{point.live}")
        return point.iteration

    def _checkpoint(self, iteration: int) -> None:
        members = self.members
        live = sorted(members.active)  # in the header too: a resume expects exactly these ranks
        checkpoint.save(self.out_dir, "server", iteration, {
            "iteration": iteration, **self.records.state(),
            "active": live, "lost": members.lost, "evaluators": members.evaluators,
            "caches": {r: c.state() for r, c in self.endpoint.caches.items()},
            "limit": None if self.limit is None else
            {"support": self.limit.support, "values": self.limit.residual[self.limit.support]},
            "value_memory": None if self.value_memory is None else self.value_memory.state(),
        }, header={"live": live})

    def _restore(self) -> None:
        state = checkpoint.load(self.out_dir, "server", self.start)  # (CheckpointError: damaged)
        self.records.restore(state)
        self.members.restore(state, self.start)
        for r, c in state["caches"].items():
            self.endpoint.caches[r].restore(c)
        if state["limit"] is not None:
            self.limit.support = state["limit"]["support"]
            self.limit.residual[self.limit.support] = state["limit"]["values"]
        if self.value_memory is not None:
            self.value_memory.restore(state.get("value_memory") or
                                      {"support": np.empty(0, np.int64),
                                       "values": np.empty(0, np.float32)})
        self.log(f"resumed at iteration {self.start}")

    # -------------------------------------------------------------------------------- ending
    def finish(self) -> None:
        """Wait for every worker's final report, verify replicas, write summary, stop workers."""
        finals = self.records.finals
        # a worker whose connection closes now never called close() (or was killed)
        self.endpoint.closed_hint = (" before its final report (a training script ends with "
                                     "ps.close(), or runs in `with psparse.connect(...) as "
                                     "ps:`, which closes a finished run)")
        self.rounds.gather(lambda: sorted(self.members.active - set(finals)),
                           lambda: "final reports", None, None, None, None)
        check_checksums(self.end, {r: f["checksum"] for r, f in finals.items()})
        if self.limit is not None and self.out_dir:
            # what the limit still holds back: sent by no round yet, kept for inspection
            np.savez(self.out_dir / "server_residual.npz", indices=self.limit.support,
                     values=self.limit.residual[self.limit.support])
        self._write_summary("ok")
        self.endpoint.shutdown(True, "training complete")
        if self.sharded and self.run_dir:  # the last shard to finish writes the merged view
            merge_run_dir(self.run_dir, self.shard[1])
        self.log(f"done: {self.end - self.start} iterations in "
                 f"{time.perf_counter() - self.records.t0:.1f} s")

    def abort(self, reason: str, ranks: list[int] | None = None) -> None:
        self.log(f"error: {reason}")
        self._write_summary("failed", reason, ranks)
        self.endpoint.shutdown(False, reason)

    def _write_summary(self, status: str, error: str | None = None,
                       failed_ranks: list[int] | None = None) -> None:
        summary = self.records.summary(
            status, error, ended=self.ended if error is None else "failed",
            world_size=self.world_size, numel=self.numel, k=self.k,
            members=self.members, limit=self.limit,
            shard=(list(self.shard), list(self.key_range)) if self.sharded else None)
        if failed_ranks is not None:
            summary["failed_ranks"] = failed_ranks
        if self.value_memory is not None:  # --values: the format, and what its memory holds
            memory = self.value_memory.residual
            summary["values"] = {
                "format": self.value_memory.value_format.name,
                "broadcast_memory": memory is not None,
                "held_l1": None if memory is None else
                round(float(np.abs(memory, dtype=np.float64).sum()), 6)}
        self.records.write_summary(summary)
