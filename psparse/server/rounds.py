"""The server's rounds: one engine for whole-model rounds and rounds in parts.

A round (docs/protocol.md, "Sequences"): with a two-phase policy every worker first proposes
and the server answers with the group's indices (or, as a key-range shard, its candidates);
then every live worker pushes, once per part (a whole-model round is one part), each push
checked against the step the agreed run sets for the iteration; a part is averaged and
broadcast as soon as every live rank has pushed it, so in a round in parts the workers receive
the later layers' aggregate while backward still runs; the record of the round goes to
metrics.jsonl. Messages that arrive meanwhile and are not what the round waits for are
dispatched here too: a worker's reports go to the records, its error message loses it, anything
else is refused.
"""

from __future__ import annotations

import time

import numpy as np

from ..ops.select.selection import NonFiniteError
from ..wire import protocol, run_description
from ..wire.protocol import ProtocolError, all_finite
from .aggregation import BudgetError
from .membership import RunAborted


class RunClosed(Exception):
    """Every live rank sent its final report after the same round of an open-ended run (a
    DDP script's end, ``close()`` on every rank): the run ends there (docs/protocol.md,
    Stopping)."""


class Rounds:
    """Serves the iterations of one agreed run (built at registration)."""

    def __init__(self, *, endpoint, records, members, run: dict, aggregators: list, parts,
                 limit, shard: tuple[int, int], value_memory=None, first_key: int = 0):
        self.endpoint, self.records, self.members = endpoint, records, members
        self.run = run
        self.parts = parts  # None: whole-model rounds (one part, no "part" field)
        self.aggregators = aggregators  # one per part
        self.limit = limit
        # --values: the broadcasts' format and their rounding error (None: float32 values)
        self.value_memory = value_memory
        self.shard = shard
        self.sharded = shard[1] > 1
        self.first_key = first_key  # a shard's first key in the model (errors name model keys)
        self.closing: set[int] = set()  # ranks whose final report came instead of a round

    # ------------------------------------------------------------------------------ a round
    def serve(self, it: int) -> list[int]:
        """Serve round ``it``; the ranks that asked to end the run with it (docs/protocol.md,
        Stopping): none, or the round was the last."""
        t_start = time.perf_counter()
        step = run_description.step_at(self.run, it)  # (budget, push cap, proposal cap), once
        upload = broadcast = upload_values = 0
        proposed = proposal_counts = None
        if self.run["two_phase"]:
            proposals, nbytes = self.collect_one(it, "propose", step)
            self._check_closing(it, proposals)
            proposal_counts = [int(proposals[r]["count"]) for r in sorted(proposals)]
            upload += nbytes
            upload_values += sum(m.extra["value_bytes"] for m in proposals.values())
            self.endpoint.pace(nbytes)
            broadcast, proposed = self._vote(it, step, [proposals[r] for r in sorted(proposals)])
        count = 1 if self.parts is None else len(self.parts) - 1
        got: list[dict[int, protocol.Message]] = [{} for _ in range(count)]
        # open: parts not aggregated yet (the last one carries any stop request, all pushes
        # of the round being in by then); stop: the ranks whose push asked to end the run
        totals = {"upload": upload, "broadcast": broadcast, "union": 0, "sent": 0,
                  "residual": 0, "dense": False, "overflow": False, "open": count,
                  "stop": set(), "upload_values": upload_values, "broadcast_values": 0}

        def on_push(msg, nbytes):
            part = msg.get("part") or 0
            got[part][msg["rank"]] = msg
            if msg.get("stop"):
                totals["stop"].add(msg["rank"])
            totals["upload"] += nbytes
            totals["upload_values"] += msg.extra["value_bytes"]
            self.endpoint.pace(nbytes)
            if self.parts is not None and not self.members.active - set(got[part]):
                self._aggregate_part(it, step, part, got[part], totals)  # broadcast at once
        self.gather(lambda: sorted({r for p in range(count) for r in self.members.active
                                    - set(got[p])}),
                    lambda: f"push messages of iteration {it}" + (
                        f" (parts {[p for p in range(count) if self.members.active - set(got[p])]})"
                        if self.parts is not None else ""),
                    it, "push", lambda peer, msg: self._check_push(peer, msg, it, step, got),
                    on_push)
        pushes = [m for part in got for m in part.values()]
        self._check_closing(it, {m["rank"]: m for m in pushes})
        self._check_checksums(it, pushes)  # a whole-model round: before anything is sent
        if self.parts is None:
            self._aggregate_part(it, step, 0, got[0], totals)
            ranks = sorted(got[0])  # every rank that pushed (an elastic loss after its push)
        else:
            ranks = sorted(self.members.active)
        ks = [sum(int(part[r]["count"]) for part in got if r in part) for r in ranks]
        losses = [m["loss"] for m in pushes if "loss" in m.header]
        # after a loss in an elastic run the record names the ranks still in it (the launcher
        # tells a worker it had already lost from a fresh failure by it)
        live = sorted(self.members.active)
        self.records.account({
            **({"live": live} if len(live) < self.members.world_size else {}),
            # whose k these are, when not every rank's (shards merge them by rank)
            **({"ranks": ranks} if len(ranks) < self.members.world_size else {}),
            "iter": it, "workers": len(ranks), "k": ks, "budget": step[0],
            "union": totals["union"], "broadcast_entries": totals["sent"],
            "residual_entries": totals["residual"], "dense": totals["dense"],
            "overflow": totals["overflow"],
            "proposed": proposed, "proposals": proposal_counts, "upload_bytes": totals["upload"],
            "broadcast_bytes": totals["broadcast"],
            "upload_value_bytes": totals["upload_values"],
            "broadcast_value_bytes": totals["broadcast_values"],
            "loss": float(np.mean(losses)) if losses else None,
            "round_s": round(time.perf_counter() - t_start, 6),
            "time_s": self.records.elapsed()})
        return sorted(totals["stop"])

    def _vote(self, it: int, step, ordered: list) -> tuple[int, int]:
        """Phase 1's answer: the group's indices (a shard: its best with their scores, the
        workers pick across shards); (wire bytes, distinct indices proposed)."""
        agg = self.aggregators[0]
        keep = step[1]  # the push cap: what the group keeps
        indices, values = [m.indices for m in ordered], [m.values for m in ordered]
        if self.sharded:
            chosen, scores, proposed = agg.candidates(indices, values, keep)
            sent = self.endpoint.broadcast("candidates", chosen.astype(agg.index_dtype,
                                                                       copy=False),
                                           scores, iter=it)
        else:
            chosen, proposed = agg.vote(indices, values, keep)
            sent = self.endpoint.broadcast("indices", chosen.astype(agg.index_dtype, copy=False),
                                           None, iter=it)
        return sent, proposed

    def _aggregate_part(self, it: int, step, part: int, pushes: dict, totals: dict) -> None:
        """A complete part's mean (through the size limit in a whole-model round), broadcast."""
        agg = self.aggregators[part]
        ranks = sorted(pushes)
        fields = dict(iter=it, workers=len(ranks))
        totals["open"] -= 1
        if totals["open"] == 0 and totals["stop"]:  # the round's last aggregate
            fields["stop"] = True
        if self.parts is not None:
            fields["part"] = part
        elif len(self.members.active) < self.members.world_size:
            # after a loss in an elastic run every aggregate names the ranks still in the run
            fields["live"] = sorted(self.members.active)
        if any(m.get("overflow") for m in pushes.values()):
            # a worker's gradient overflowed (GradScaler): every worker skips this step, so
            # nothing is averaged and the size limit's residual stays as it was
            totals["overflow"] = True
            nothing = np.empty(0, agg.index_dtype)
            nothing.flags.writeable = False  # as every broadcast index set (the key caches)
            totals["broadcast"] += self.endpoint.broadcast(
                "aggregate", nothing, np.empty(0, np.float32), model_size=agg.numel,
                overflow=True, **fields)
            return
        union, mean = agg.mean([None if pushes[r].get("dense") else pushes[r].indices
                                for r in ranks], [pushes[r].values for r in ranks])
        offset = 0 if self.parts is None else int(self.parts[part])  # the part's first key
        guard = Overflow(it, pushes, ranks, offset, self.first_key)
        guard.check("sum of the pushes", union, mean)
        sent_idx, sent_val = union, mean
        if self.limit is not None:
            sent_idx, sent_val = guard.around("mean plus the size limit's residual", lambda:
                                              self.limit.apply(union, mean, self.limit.entries(
                                                  step[0], len(ranks), self.shard)))
            totals["residual"] = int(self.limit.support.size)
            guard.check("mean plus the size limit's residual", sent_idx, sent_val)
        totals["union"] += int(union.size)
        totals["sent"] += int(sent_idx.size)
        if self.value_memory is not None:
            fields["value_format"] = self.value_memory.value_format
        if agg.goes_dense(sent_idx.size):
            totals["dense"] = True
            vector = agg.densify(sent_idx, sent_val)
            if self.value_memory is not None:  # rounded in the dense frame's layout
                vector = guard.around("mean plus the broadcast's rounding memory", lambda:
                                      self.value_memory.dense(sent_idx, sent_val, vector,
                                                              offset))
            totals["broadcast"] += self.endpoint.broadcast(
                "aggregate", None, vector, dense=True, **fields)
            totals["broadcast_values"] += self.endpoint.last_value_bytes
            return
        if self.value_memory is not None:
            sent_val = guard.around("mean plus the broadcast's rounding memory", lambda:
                                    self.value_memory.sparse(sent_idx, sent_val, offset))
        sent_idx = sent_idx.astype(agg.index_dtype, copy=False)
        sent_idx.flags.writeable = False  # never changed again: the key caches hold it
        totals["broadcast"] += self.endpoint.broadcast(
            "aggregate", sent_idx, sent_val, model_size=agg.numel, **fields)
        totals["broadcast_values"] += self.endpoint.last_value_bytes

    # ---------------------------------------------------------------------------- messages
    def collect_one(self, it: int, msg_type: str, step) -> tuple[dict, int]:
        """One ``msg_type`` message of iteration ``it`` from every live rank, and their wire
        bytes (a whole-model round's proposals)."""
        got: dict[int, protocol.Message] = {}
        nbytes = [0]

        def keep(msg, size):
            got[msg["rank"]] = msg
            nbytes[0] += size
        self.gather(lambda: sorted(self.members.active - set(got)),
                    lambda: f"{msg_type} messages of iteration {it}", it, msg_type,
                    lambda peer, msg: self._check_one(peer, msg, it, step, got), keep)
        return got, nbytes[0]

    def gather(self, missing, what, it: int | None, msg_type: str | None, check, keep) -> None:
        """Receive until ``missing()`` is empty: ``msg_type`` messages of iteration ``it`` that
        pass ``check(peer, msg)`` go to ``keep(msg, nbytes)``; others are dispatched."""
        deadline = self.endpoint.deadline()
        if it is not None:  # a rank that has closed sends nothing of this round
            waiting = missing
            missing = lambda: [r for r in waiting() if r not in self.closing]  # noqa: E731
        while waiting_for := missing():
            received = self.endpoint.wait(lambda: f"{what()} from ranks {waiting_for}",
                                          deadline, waiting_for, it)
            if received is None:  # a rank was lost (elastic): wait for the others only
                continue
            peer, frames, nbytes = received
            msg = self.endpoint.accept(peer, frames)
            if msg is None or not self._wanted(peer, msg, what(), it, msg_type):
                continue
            if check(peer, msg):
                self.endpoint.remember(msg)
                keep(msg, nbytes)

    def _check_one(self, peer, msg, it, step, got) -> bool:
        """A whole-model round's message: one per rank, within its cap."""
        if msg["rank"] in got:
            self.endpoint.reject(peer, ProtocolError(f"rank {msg['rank']} already sent "
                                                     f"{msg.type} for iteration {it}"))
            return False
        return self._within(peer, msg, it, step, self.aggregators[0])

    def _check_push(self, peer, msg, it, step, got) -> bool:
        """A push: one per rank (and part), within the cap (a rank's parts together too); an
        overflow push carries nothing."""
        if msg.get("overflow") and (msg["count"] or msg.get("dense")):
            self.endpoint.reject(peer, ProtocolError(
                f"rank {msg['rank']}'s overflow push of iteration {it} carries entries "
                f"(count {msg['count']}): an overflow push has count 0"))
            return False
        if self.parts is None:
            return self._check_one(peer, msg, it, step, got[0])
        rank, part = msg["rank"], msg["part"]
        if rank in got[part]:
            self.endpoint.reject(peer, ProtocolError(f"rank {rank} already sent part {part} "
                                                     f"of iteration {it}"))
            return False
        if not self._within(peer, msg, it, (step[0], step[1], 0), self.aggregators[part]):
            return False
        entries = lambda m: int(np.count_nonzero(m.values)) if m.get("dense") \
            else int(m["count"])  # noqa: E731
        total = sum(entries(p[rank]) for p in got if rank in p) + entries(msg)
        if total > step[1]:
            self.endpoint.reject(peer, ProtocolError(
                f"rank {rank}'s pushes of iteration {it} have {total} entries in all, more "
                f"than the push cap of {step[1]}"))
            return False
        return True

    def _within(self, peer, msg, it, step, agg) -> bool:
        """A push or proposal carries at most the cap the agreed run sets for this iteration;
        a dense push only where the cap makes dense the smaller form."""
        try:
            agg.check_budget(msg.type, it, step, msg["count"],
                             msg.values if msg.get("dense") else None)
            return True
        except BudgetError as exc:  # not aggregated; the rank may send a valid one
            self.endpoint.reject(peer, ProtocolError(str(exc)))
            return False

    def _wanted(self, peer: bytes, msg: protocol.Message, what: str, it: int | None,
                msg_type: str | None) -> bool:
        """Whether an accepted message is a ``msg_type`` of iteration ``it`` (what the caller
        collects). Anything else is handled here: metrics are recorded, a worker's error loses
        it, other types and iterations are rejected."""
        if msg.type == "metrics":
            self.records.report(msg["rank"], msg["report"], msg["iter"], msg.get("checksum"),
                                self.members.evaluators[-1]["rank"])
            if it is not None and msg["report"].get("final"):
                self._final_during(it, msg)
        elif msg.type == "error":  # the worker gives up and says why
            self.members.lose([self.members.peers[peer]], it, what, msg["message"])
            # elastic: the run goes on; acknowledge, so the worker can exit knowing its
            # cause is recorded (without --elastic, the abort tells everyone)
            self.endpoint.try_send(peer, protocol.encode(
                "shutdown", ok=False, reason="dropped from the run: " + msg["message"]))
        elif msg_type is None or msg.type != msg_type:
            self.endpoint.reject(peer, ProtocolError(f"unexpected {msg.type} message; the "
                                                     f"server waits for {what}"))
        elif msg["iter"] != it:
            self.endpoint.reject(peer, ProtocolError(f"{msg_type} for iteration {msg['iter']}, "
                                                     f"the server is at iteration {it}"))
        elif (self.parts is not None) != ("part" in msg.header):
            self.endpoint.reject(peer, ProtocolError(
                f"{msg_type} with a 'part' field, but this run is not exchanged in parts"
                if self.parts is None else
                f"this run is exchanged in parts: a {msg_type} must carry 'part'"))
        else:
            return True
        return False

    def _final_during(self, it: int, msg) -> None:
        """A final report while round ``it`` is served: in an open-ended run, the rank ends
        after its round ``msg['iter']`` (the run ends there once every rank has, and must
        be ``it - 1``); in a run of fixed length it is an early end, and the run's."""
        rank, last = msg["rank"], msg["iter"]
        if self.run["iterations"]:
            raise RunAborted(f"rank {rank} closed after iteration {last} of a run of "
                             f"{self.run['iterations']} iterations: every rank must make "
                             "the same exchanges")
        if last != it - 1:
            raise RunAborted(f"rank {rank} closed after iteration {last}, but the server "
                             f"serves iteration {it}: every rank must make the same exchanges")
        self.closing.add(rank)

    def _check_closing(self, it: int, received: dict) -> None:
        """After a round's messages are in: nobody closed, or everyone did (RunClosed); some
        ranks closing while others go on is a mismatch, and the run's end, naming both."""
        if not self.closing:
            return
        if received:
            raise RunAborted(
                f"rank{'s' if len(self.closing) > 1 else ''} "
                f"{', '.join(map(str, sorted(self.closing)))} closed after iteration {it - 1} "
                f"(the script ended) while rank{'s' if len(received) > 1 else ''} "
                f"{', '.join(map(str, sorted(received)))} sent iteration {it}: every rank must "
                "make the same exchanges (end an open-ended run with ps.stop(), or end every "
                "rank's loop after the same round)")
        raise RunClosed(it - 1)

    def _check_checksums(self, it: int, pushes: list) -> None:
        checksums: dict[int, str] = {}
        for m in pushes:  # one checksum per rank and iteration (any part may carry it)
            if m.get("checksum") is not None:
                if checksums.get(m["rank"], m["checksum"]) != m["checksum"]:
                    raise RunAborted(f"rank {m['rank']} sent two checksums for iteration {it}")
                checksums[m["rank"]] = m["checksum"]
        check_checksums(it, checksums)


class Overflow:
    """The overflow rule (docs/protocol.md, Rounds): every value of a round's aggregate is
    finite. Finite pushes can still sum past float32's range, and so can the mean plus what
    the size limit or a value format's rounding memory holds; such a round is never broadcast
    (a receiver refuses a non-finite value, and a memory holding inf would poison that key for
    ever): the run ends, naming the model's key and the ranks that pushed there."""

    def __init__(self, it: int, pushes: dict, ranks: list[int], offset: int, first_key: int):
        self.it, self.pushes, self.ranks = it, pushes, ranks
        self.offset, self.first_key = offset, first_key  # part-relative -> shard -> model keys

    def check(self, what: str, indices: np.ndarray, values: np.ndarray) -> None:
        if not all_finite(values):
            first = int(np.flatnonzero(~np.isfinite(values))[0])
            self.fail(what, int(indices[first]), float(values[first]))

    def around(self, what: str, step):
        """``step()``, whose sums raise NonFiniteError (with the part's ``key``) on overflow."""
        try:
            return step()
        except NonFiniteError as exc:
            self.fail(what, getattr(exc, "key", self.offset) - self.offset, None)

    def fail(self, what: str, local: int, value: float | None):
        pushed = [r for r in self.ranks if self._pushed(self.pushes[r], local)]
        there = f"ranks {pushed} pushed values there" if pushed else \
            "no rank pushed there this round (what the server held back did)"
        key = local + self.offset + self.first_key
        raise RunAborted(f"the aggregate of iteration {self.it} overflows float32 at key {key}: "
                         f"the {what} there is {'inf' if value is None else value} ({there}; "
                         "float32 ends at ~3.4e38): the gradients are exploding; lower --lr, "
                         "or use --clip-norm", pushed or list(self.ranks))

    @staticmethod
    def _pushed(msg, local: int) -> bool:
        if msg.values is None:
            return False
        if msg.get("dense"):
            return bool(msg.values[local] != 0)
        at = int(np.searchsorted(msg.indices, local))
        return at < msg.indices.size and int(msg.indices[at]) == local


def check_checksums(it: int, checksums: dict) -> None:
    """Every checksum reported for an iteration (or the end) is the same, or the run ends."""
    reported = {r: c for r, c in checksums.items() if c is not None}
    if len(set(reported.values())) > 1:
        raise RunAborted(f"replicas diverged before iteration {it}: weight checksums " +
                         ", ".join(f"rank {r}={c}" for r, c in sorted(reported.items())))
