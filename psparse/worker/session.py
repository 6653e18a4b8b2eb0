"""A worker's side of a run for any training loop: ``Session``, where the loop meets the exchange.

A worker's side of a psparse run, for any training loop: ``Session`` (``psparse.connect``
makes one, psparse/connect.py).

A user keeps their own loop and adds a handful of lines::

    with psparse.connect(model, optimizer, iterations=len(loader) * epochs) as ps:
        for x, y in loader:                   # or: while ps.running (ps.stop() ends the run)
            loss = loss_fn(model(x), y)
            loss.backward()
            ps.exchange(loss)                 # error feedback, selection, push, aggregate -> .grad
            optimizer.step()
            optimizer.zero_grad()
        ps.close()                            # final report; the server writes summary.json

``exchange`` folds the local gradient into the error-feedback accumulator, lets the selection policy
pick this round's entries, sends them to the server (``psparse.worker.client``) and writes the
aggregate into every parameter's ``.grad``, so any ``torch.optim`` optimizer then applies the same
update on every replica. The built-in ``psparse-worker`` loop is a user of this class too.

The session builds a worker's parts (flat model, device backend, memory, policy, client) and
its round: ``round.Round`` with the host's engine (``round.HostEngine``) or a GPU's
(``device_round.DeviceEngine``), whole or in buckets through ``parts.Parts``; they see it only
through a ``RoundContext``. The session
keeps what is the user's: registration, the run's length and evaluator, the end of the run,
checkpoints (their state: psparse/worker/session_state.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from ..backends.devices import device_backend
from ..config import ConfigError, RunConfig
from ..ops import jit
from ..ops.select.sparsify import density_to_k
from ..policies import Layout, PolicyError, build_policy
from ..policies.memory import SCALECOM_BETA, Memory, density_schedule
from ..rundir import EVAL_VALUES, rank_file, write_atomic
from . import amp, lifecycle
from .board import TimingLog
from .checks import check_model, check_optimizer, check_options
from .client import ServerGone, WorkerError
from .device_round import DeviceEngine
from .exchange import RoundContext, budget_steps, round_shape
from .flat_model import FlatModel
from .local_steps import LocalSteps
from .optimizers import as_optimizer
from .parts import Parts
from .recall import RecallProbe
from .round import HostEngine, Round
from .selections import SelectionRecorder
from .session_state import Checkpointed
from .sharded_client import open_client

__all__ = ["Session", "WorkerError", "ServerGone", "failure_cause"]


class Session(lifecycle.LoopControl, Checkpointed):
    """One worker's side of a psparse run, for any training loop (see the module's docstring).

    Attributes a loop reads: ``rank``, ``world_size``, ``start`` (first iteration: > 0 after a
    resume), ``iterations`` (None: open-ended), ``iteration`` (the next exchange's), ``running``
    (another exchange is due; lifecycle.LoopControl), ``evaluator`` (the rank whose
    ``log`` values are recorded), ``k`` and ``stats`` (bytes and seconds so far).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 cfg: RunConfig, *, rank: int,
                 server: tuple[str, int] | list[tuple[str, int]], iterations: int | None,
                 batches_per_epoch: int | None = None, out_dir: str | Path | None = None,
                 run_token: str | None = None, resume: bool = False, device=None, say=None,
                 scaler=None):
        if not 0 <= rank < cfg.workers:
            raise WorkerError(f"rank {rank} out of range [0, {cfg.workers})")
        self.cfg, self.rank, self.world_size = cfg, rank, cfg.workers
        self.length = lifecycle.RunLength(iterations)  # fixed, or open-ended (0 / None)
        self.iterations = self.length.iterations
        # with local steps an iteration is a synchronisation of H steps: epochs count those
        self.batches_per_epoch = batches_per_epoch / cfg.local_steps \
            if batches_per_epoch and cfg.local_steps > 1 else batches_per_epoch
        # a torch.amp.GradScaler given at connect: every step's gradients are scaled by it
        # (with --overlap and the DDP hook the buckets leave during backward, so it must be
        # known before exchange()); _step_scaler: the one of the round under way
        self.scaler = self._step_scaler = scaler
        # closed at the script's end if it is left open (the DDP comm hook's sessions: a DDP
        # script calls nothing of psparse but register; psparse.worker.lifecycle)
        self.auto_close = False
        self.board = None  # --tensorboard on rank 0: its time split per iteration (board.py)
        self.out_dir = Path(out_dir) if out_dir else None
        self._t_created = time.perf_counter()
        self._say = say  # where progress lines go (default: stderr)
        check_model(model)
        if device is None:  # where the trainable parameters are
            device = next(p for p in model.parameters() if p.requires_grad).device
        self.net = FlatModel(model, torch.device(device))
        self.device = self.net.device
        self.optimizer = as_optimizer(optimizer)  # several: one object with their state
        # the GPU path: accumulator, selection and policy state on the device (a backend,
        # psparse.backends.cuda); None: the host path
        self.dev = device_backend(self.device, self.say)
        check_options(cfg, batches_per_epoch, on_device=self.dev is not None)
        self.memory = Memory(self.net.numel, cfg.memory, cfg.momentum, cfg.clip_norm,
                             beta=SCALECOM_BETA if cfg.memory_beta is None else cfg.memory_beta,
                             dev=self.dev)
        check_optimizer(self.optimizer, self.memory, cfg, self.out_dir)
        self.k = density_to_k(cfg.density, self.net.numel)
        self.policy = build_policy(cfg.policy, cfg.policy_args,
                                   Layout(self.net.layer_sizes, cfg.granularity),
                                   self._k_at(0), rank=rank, world_size=cfg.workers,
                                   seed=cfg.seed, dev=self.dev)
        self.live = list(range(cfg.workers))  # ranks still in the run (elastic runs lose some)
        self.client, self.servers = open_client(cfg, server, rank, self.net.numel, run_token)
        self.client.feedback = self.memory.feed_back  # a rounded push's error (--values)
        self.start = self.iteration = 0
        self.last_report: tuple[int, dict] | None = None  # the evaluator's latest, for resume
        self._buffers_at_checkpoint = None  # model buffers as they were after the update
        self._checkpoint_due = None  # local steps: (iteration, state) to write at the next step
        self.closed = False
        self._accumulating = False  # inside ps.accumulating(): backward passes only
        self.local = LocalSteps(self.net, cfg) if cfg.local_steps > 1 else None
        if self.local is not None and scaler is not None:
            raise ConfigError("with local_steps the GradScaler is the local steps' own (each "
                              "worker's, like its optimizer): do not give it to connect()")
        self.ctx = RoundContext(
            cfg=cfg, net=self.net, memory=self.memory, policy=self.policy, client=self.client,
            budget=self._k_at, note_live=self._note_round, applied=self._applied,
            before=self._before_round, iteration=lambda: self.iteration, say=self.say,
            recorder=SelectionRecorder(self.net.layer_sizes, self.net.layer_names)
            if cfg.record_selections else None)
        self.parts: Parts | None = None  # --bucket-mb / --overlap: the round in buckets
        try:
            self._build_rounds()
            if resume:
                self._restore()
                self.policy.set_k(self._k_at(self.start))
            if cfg.probe_recall:  # after a resume: its start drops the rows written again
                if self.out_dir is None:
                    raise ConfigError("--probe-recall needs the run directory (out= or "
                                      "PSPARSE_OUT): the workers meet there")
                self.ctx.probe = RecallProbe(self.out_dir, rank, cfg.probe_recall, self.start,
                                             live=lambda: self.live, say=self.say)
        except BaseException:
            self.client.close()  # not registered yet: nobody to tell, just leave
            raise

    def _build_rounds(self) -> None:
        """The budget steps the server will enforce, and the round object: on the host or the
        device, whole or in buckets of layers."""
        cfg = self.cfg
        if cfg.dense_warmup and self.policy.dense_warmup_refusal():
            raise ConfigError(self.policy.dense_warmup_refusal())
        # an open-ended run's budget steps: through the end of the (dense or density) warm-up
        horizon = self.iterations or max(cfg.dense_warmup, math.ceil(
            cfg.density_warmup * (self.batches_per_epoch or 0))) + 1
        self.steps = budget_steps(self.policy, self._k_at, horizon,
                                  bool(cfg.density_warmup or cfg.dense_warmup), self.start)
        whole = all(step[1] == self.net.numel for step in self.steps)
        shape = round_shape(self.policy, whole)
        engine = DeviceEngine(self.ctx, self.dev, shape) if self.dev is not None \
            else HostEngine(self.ctx, shape)
        self.rounds = Round(self.ctx, engine)
        if cfg.overlap or cfg.bucket_mb is not None:
            self.parts = Parts(self.ctx, self.rounds, self.servers)

    # ----------------------------------------------------------------------------- basics
    def log(self, **values) -> None:
        """Evaluation results of the iteration just exchanged (``test_acc=``, ``test_loss=``,
        ``train_loss=``, ``epoch=``) into the run's eval.jsonl. Only the evaluator's are
        recorded (on other ranks this returns at once), so every rank may call it."""
        _check_eval_values(values)
        if not self.is_evaluator:
            return  # only the evaluator's results are the run's (the server ignores others')
        values = {k: float(v) for k, v in values.items()}
        if "epoch" not in values and self.batches_per_epoch:
            values = {"epoch": round(self.iteration / self.batches_per_epoch, 4), **values}
        self.last_report = (self.iteration - 1, values)
        self.client.report(*self.last_report)

    def say(self, text: str) -> None:
        """A progress line on stderr, prefixed with the rank and the time since connect."""
        if self._say is not None:
            self._say(text)
        else:
            print(f"[rank {self.rank} +{time.perf_counter() - self._t_created:.1f}s] {text}",
                  file=sys.stderr, flush=True)

    @property
    def evaluator(self) -> int:
        """The rank that evaluates: rank 0, or the lowest live rank once rank 0 was lost."""
        return min(self.live)

    @property
    def is_evaluator(self) -> bool:
        return self.rank == self.evaluator

    @property
    def stats(self) -> dict:
        return {"push_bytes": self.client.sent_bytes, "aggregate_bytes":
                self.client.received_bytes, **self.ctx.clock.times}

    def _k_at(self, it: int) -> int:
        """Entries to send at iteration ``it``: all of them during a dense warm-up; the
        density warm-up lowers it epoch by epoch."""
        if it < self.cfg.dense_warmup:
            return self.net.numel
        if not self.cfg.density_warmup:
            return self.k
        epoch = it / self.batches_per_epoch
        density = density_schedule(self.cfg.density, self.cfg.density_warmup, epoch)
        return density_to_k(density, self.net.numel)

    # ------------------------------------------------------------------------- registration
    def register(self) -> None:
        """Join the run: every worker registered and agreed (the server checks) or an error."""
        if self.dev is None:  # the host's kernels, before the first round (psparse/ops/jit.py)
            jit.preload(("select_kernels", "codec_kernels") +
                        (("agg_kernels",) if self.cfg.servers > 1 else ()) +
                        (("value_kernels",) if self.cfg.values != "fp32" else ()),
                        self.net.numel, self.say)
        self.client.register(self.describe_run(), self.net.checksum(), self.start)
        lifecycle.opened(self)  # a script that ends without close() is told so
        self.say(f"registered: numel={self.net.numel} k={self.k} "
                 f"iterations={self.iterations or 'open-ended'} "
                 f"policy={self.policy.describe()} memory={self.cfg.memory}"
                 + (f"(beta={self.memory.beta})" if self.cfg.memory == "scalecom" else ""))
        if self.last_report is not None and self.last_report[0] == self.start - 1:
            self.client.report(*self.last_report)  # the server may not have written it
        if self.cfg.tensorboard and self.rank == 0 and self.out_dir is not None:
            self.board = TimingLog(self.out_dir)
        self.ctx.clock.restart()
        if self.board is not None:
            self.board.add(self.start - 1, self.ctx.clock.times)  # the totals it starts from

    def describe_run(self) -> dict:
        """The run every rank must agree on (docs/protocol.md, "The run"): size, length, round
        kind, budget steps, shared options and layer shapes, parts, values, shard edges."""
        config = {**self.cfg.agreed(), "layers": [
            f"{name}:{'x'.join(map(str, shape))}"
            for name, shape in zip(self.net.layer_names, self.net.layer_shapes)]}
        run = {"numel": self.net.numel, "iterations": self.iterations or 0,
               "two_phase": self.policy.two_phase, "steps": self.steps, "config": config}
        if self.parts is not None:
            run["parts"] = self.parts.edges
        if self.cfg.value_spec() is not None:  # --values: the format every rank must share
            run["values"] = self.cfg.value_spec()
        if self.cfg.shard_edges is not None:  # the shards' ranges: [0, E1, ..., numel]
            run["shard_edges"] = self.client.edges.tolist()
        return run

    # --------------------------------------------------------------------------------- round
    def exchange(self, loss=None, *, scaler=None) -> None:
        """One synchronous round: this worker's gradient in, everyone's aggregate out.

        Reads the parameters' ``.grad`` (after ``loss.backward()``), adds it to the
        error-feedback accumulator, sends the policy's selection, and writes the aggregate
        (the mean over workers) into every parameter's ``.grad``, ready for
        ``optimizer.step()``. ``loss`` (a tensor or a float) is averaged into metrics.jsonl.
        ``scaler``: the ``torch.amp.GradScaler`` whose scaled gradients these are (default:
        the one given to ``connect``); then ``scaler.step(optimizer)`` and ``scaler.update()``
        follow (psparse.worker.amp).
        """
        if self.local is not None:
            raise WorkerError("this run has local_steps >= 2: call ps.local_step(loss) after "
                              "every optimizer.step(), not exchange() (docs/api.md, Local "
                              "steps)")
        self._exchange(loss, scaler)

    def _exchange(self, loss, scaler) -> None:
        if scaler is not None and self.scaler is not None and scaler is not self.scaler:
            raise WorkerError("exchange(scaler=...) got another GradScaler than the one given "
                              "to connect(): use one scaler for the run")
        started = self.parts is not None and self.parts.in_round
        if started and scaler is not None and scaler.is_enabled() and self.ctx.scaling is None:
            raise WorkerError("exchange(scaler=...) with --overlap: the buckets left during "
                              "backward, before exchange() was called, still scaled; give the "
                              "GradScaler to connect(..., scaler=scaler) (or psparse.ddp_hook."
                              "register(model, scaler=scaler)) so that they are unscaled")
        if not started:
            self._step_scaler = scaler if scaler is not None else self.scaler
        it = self.iteration
        if self._accumulating:
            raise WorkerError("exchange() inside ps.accumulating(): the micro-batches inside "
                              "only accumulate; do the last one's backward and exchange() "
                              "after the with block")
        if not self.net.grads_changed():
            raise lifecycle.missing_backward(it)
        if self.parts is not None:
            return self.parts.exchange(it, loss)  # its first bucket runs _before_round
        self._before_round(it)
        self.rounds.exchange(it, loss)

    def _before_round(self, it: int) -> None:
        """What precedes round ``it``: it is within the run, its GradScaler's scale (if any)
        is read, and a checkpoint due is written (the state after iteration it - 1's update,
        untouched yet)."""
        self.length.check_round(it)
        self.ctx.scaling = amp.scaling_for(self._step_scaler, self.optimizer,
                                           self.ctx.scaling)
        if self.cfg.checkpoint_every and it > self.start and it % self.cfg.checkpoint_every == 0 \
                and self.local is None:  # local steps: written at the synchronisation
            self._checkpoint(it)

    def local_step(self, loss=None) -> bool:
        """With ``local_steps`` H >= 2, after every ``optimizer.step()``: every H-th call
        synchronises -- the pseudo-gradient (the weights' change since the last
        synchronisation) goes through the exchange, and the outer step sets the weights every
        rank shares (psparse/worker/local_steps.py). Returns whether this call synchronised.
        ``loss``: the step's loss; their mean goes into metrics.jsonl."""
        if self.local is None:
            raise WorkerError("local_step() is for runs with local_steps >= 2; this one "
                              "exchanges every iteration: call exchange(loss) before "
                              "optimizer.step()")
        if self._checkpoint_due is not None:  # the state at the synchronisation, written
            self._checkpoint(*self._checkpoint_due)  # now with the evaluation logged since
            self._checkpoint_due = None
        if not self.local.note_step(loss):
            return False
        self._exchange(self.local.pseudo_gradient(), None)
        self.local.outer_step()
        ce = self.cfg.checkpoint_every
        if ce and self.iteration % ce == 0 and self.iteration < (self.iterations or math.inf):
            self._checkpoint_due = (self.iteration, self.state_dict(frozen=True))
        return True

    def _note_round(self, agg) -> None:
        """What an aggregate's header says about the run: a stop request (this round is the
        last), fewer live ranks."""
        self.length.note(agg, agg["iter"])
        if "live" in agg.header and agg["live"] != self.live:
            self.live = sorted(agg["live"])  # an elastic run lost workers (docs/protocol.md)
            self.policy.set_live(self.live)
            self.say(f"live ranks now {self.live}; rank {self.evaluator} evaluates")

    def _applied(self, it: int) -> None:
        """Iteration ``it`` is applied: the next one's number, and the buffers a checkpoint of
        the next iteration must keep."""
        self.iteration = it + 1
        self._step_scaler = self.scaler  # the next round's, unless exchange() names one
        if self.board is not None:  # --tensorboard: rank 0's time split of the iteration
            self.board.add(it, self.ctx.clock.times)
        self.net.mark_grads()  # the next exchange needs a backward pass after this
        if self.cfg.checkpoint_every and self.iteration % self.cfg.checkpoint_every == 0:
            # The checkpoint of iteration it + 1 is written at the next exchange, once the
            # optimizer has stepped; by then the next forward pass has moved buffers such as
            # BatchNorm's running statistics, so keep them as they are now.
            self._buffers_at_checkpoint = {name: b.detach().clone()
                                           for name, b in self.net.model.named_buffers()}

    # -------------------------------------------------------------------------------- ending
    def close(self, **final) -> None:
        """End of training: the final report (with the evaluator's ``final`` values, e.g.
        ``close(test_acc=...)``, and the weight checksum), the server's shutdown, then this
        rank's rank-R.json. The server writes summary.json."""
        self.length.check_close(self.iteration)
        _check_eval_values(final)
        wall = time.perf_counter() - self._t_created
        # the rounds' device crossings, before the reads of the final report below
        device = self.rounds.engine.report(self.iteration - self.start) \
            if isinstance(self.rounds.engine, DeviceEngine) else None
        values = {k: float(v) for k, v in final.items()} if self.is_evaluator else {}
        self.client.finish(self.iteration - 1, values, self.net.checksum())
        info = {"rank": self.rank, "iterations": self.iteration, "numel": self.net.numel,
                "k": self.k, "checksum": self.net.checksum(), "wall_s": round(wall, 3),
                "policy": self.policy.describe(), "policy_state": self.policy.state_digest(),
                "options": self.cfg.agreed(),
                **({"overlap": self.parts.report()} if self.parts is not None else {}),
                **({"device": device} if device is not None else {}),
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in self.stats.items()}}
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.out_dir / rank_file(self.rank), json.dumps(info, indent=2))
            if self.ctx.recorder:
                self.ctx.recorder.save(self.out_dir / f"selections-rank-{self.rank}.npz")
        self.say(f"done in {wall:.1f} s (checksum {info['checksum']})")
        self.disconnect()

    def fail(self, exc: BaseException) -> None:
        """Report why this worker stops (summary.json names the cause), then disconnect."""
        if not isinstance(exc, ServerGone):
            self.client.give_up(failure_cause(exc))
        self.disconnect()

    def disconnect(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if not self.closed:
            self.closed = True
            lifecycle.closed(self)
            if self.parts is not None:
                self.parts.remove_hooks()
            self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``with psparse.connect(...) as ps:`` -- an exception is reported to the server (its
        cause reaches summary.json); a complete run not closed yet is closed."""
        if self.closed:
            return
        if exc is not None:
            self.fail(exc)
        elif not self.length.check_close_ok(self.iteration):
            early = WorkerError(f"left the run {self.length.where(self.iteration)}: end it "
                                "with ps.stop(), or run every iteration agreed at connect")
            self.fail(early)
            raise early
        else:
            self.close()


def failure_cause(exc: BaseException) -> str:
    """An exception as summary.json names a worker's failure: psparse's own errors by their
    text, anything else with its type."""
    return str(exc) if isinstance(exc, (WorkerError, PolicyError, ConfigError)) \
        else f"{type(exc).__name__}: {exc}"


def _check_eval_values(values: dict) -> None:
    unknown = sorted(set(values) - set(EVAL_VALUES))
    if unknown:
        raise ValueError(f"unknown evaluation value {', '.join(unknown)}; eval.jsonl records "
                         f"{', '.join(EVAL_VALUES)}")
