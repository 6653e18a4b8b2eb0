"""``--max-restarts R``: a failed run restarts itself from its newest complete checkpoint.

When any process of a run fails or is lost, the supervisor stops the others (supervisor.py).
With ``--max-restarts R`` the launcher then waits a back-off and starts the whole run again,
resuming from the newest iteration for which every process saved a checkpoint
(psparse/checkpoint.py), up to R times, as torchrun's ``--max-restarts`` restarts its worker
group. When no checkpoint is complete yet, the run starts again from the beginning. A run that
fails again with the same cause at the same iteration is not restarted again: that fault is in
the run (its data, its code), not in a machine, and would only repeat. A process ended by
SIGKILL, SIGTERM, SIGINT or SIGHUP (an operator, a scheduler, the OOM killer) is restarted
whatever came before, up to R times: the signal came from outside the run.

Each attempt's logs stay in ``logs/attempt-I/``. summary.json gets ``attempts``: one record per
attempt with its cause (the first process that failed, its exit code, the iterations completed
and the message) and the checkpoint it resumed from (docs/run-directory.md). A failed run whose
server left no summary.json (a killed server, a launcher error) gets one from the launcher, so
every failure's cause is in the run directory.

A run that could not start is not restarted at all: a port in use, a data set or a program
missing (the launcher's checks, plan.StartFailure), a command that exits 126/127 (its
interpreter or program not found or not executable: --python, --rsh), or a worker that reported
an error before training (its data set missing on its host, a bad model): the same start would
fail the same way.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import checkpoint
from ..rundir import METRICS_FILE, SUMMARY_FILE, read_jsonl, write_json
from ..server.membership import BEFORE_TRAINING
from ..wire import keyranges
from .supervisor import is_server

BACKOFF_S = 2.0  # default wait before a restart: ports and sockets of the stopped run close
STOPPED = "terminated by signal"  # how a server's summary begins when the launcher stopped it
# exit codes of a shell (ssh's remote one, srun's) whose command could not be run at all
NOT_STARTED = {126: "its program is not executable", 127: "its program was not found"}
# signals that come from outside a run (an operator, a scheduler, the OOM killer): a process
# they end is restarted even after the same failure (a SIGSEGV or SIGABRT is the run's own)
OUTSIDE_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


@dataclass
class Attempt:
    number: int  # 0: the first start
    resumed_from: int | None  # the checkpoint's iteration; None: from the beginning
    started_at: float  # time.time()
    exit_code: int | None = None  # the run's (0: finished)
    process: str | None = None  # the first process that failed: "rank-1", "server", ...
    process_exit_code: int | None = None  # its exit code (negative: the signal that ended it)
    iterations_done: int | None = None  # rounds recorded when it failed
    error: str | None = None  # the server's words (summary.json), else the process's last line
    noticed_at: float | None = None  # when the launcher saw the failure
    stopped_at: float | None = None  # when the other processes had been stopped
    ranks: list[int] | None = None  # the worker ranks started, when not all (elastic resume)
    start_failure: bool = False  # it could not start (``error`` says why): no restart

    def cause(self) -> tuple:
        """What must repeat for "the same fault again": who, where, and what it said."""
        return self.process, self.iterations_done, self.error

    def describe(self) -> str:
        if self.start_failure:  # its error is a whole sentence, naming who could not start
            return self.error
        done = self.iterations_done
        if done is not None and self.resumed_from is not None and done <= self.resumed_from:
            where = f" while resuming at iteration {self.resumed_from}, before its first round"
        else:
            where = "" if done is None else \
                " before its first iteration" if done == 0 else f" after {done} iterations"
        return f"{self.process or 'the run'} failed{where}: {self.error}"


def resume_point(out: Path, world_size: int, shards: int) -> checkpoint.ResumePoint | None:
    return checkpoint.resume_point(out, world_size, shards)


def iterations_done(out: Path, attempt: Attempt | None = None) -> int | None:
    """Rounds the run has recorded; for ``attempt``, one that resumed and recorded nothing
    itself (metrics.jsonl untouched since it started: the server died before it listened, or
    while it loaded its checkpoint), its resume point: what is there is the earlier attempts'
    (rows past the resume point that the new server had not yet dropped)."""
    path = out / METRICS_FILE
    if not path.is_file():
        return None
    if attempt is not None and attempt.resumed_from is not None and \
            path.stat().st_mtime < attempt.started_at:
        return attempt.resumed_from
    try:
        return len(read_jsonl(path))
    except ValueError:  # a damaged line: the count is unknown (the server's error names it)
        return None


def record_failure(attempt: Attempt, out: Path, code: int, supervisor) -> None:
    """Fill in ``attempt``'s cause: the first process that failed and what it said. The
    server's summary.json has the words when the server failed on its own or names the workers
    that did (``failed_ranks``); when a worker failed before the server knew of it (e.g. before
    it registered), the server's summary only says it was stopped, and the worker's own last
    log line is the cause."""
    attempt.exit_code = code
    name, proc_code = supervisor.failure or (None, code)
    attempt.process, attempt.process_exit_code = name, (proc_code if name else None)
    attempt.noticed_at, attempt.stopped_at = supervisor.noticed_at, supervisor.stopped_at
    attempt.iterations_done = iterations_done(out, attempt)
    if supervisor.start_failed:  # the launcher's own words (plan.StartFailure)
        attempt.error, attempt.start_failure = supervisor.error, True
        return
    summary = read_summary(out) or {}
    server_error = summary.get("error") if summary.get("status") != "ok" else None
    ranks = summary.get("failed_ranks")
    attempt.start_failure = bool(server_error) and BEFORE_TRAINING in server_error
    if server_error and ranks:
        attempt.error = server_error
        if name not in [f"rank-{r}" for r in ranks]:
            # the server knows which worker failed; the others it stopped may be reaped first
            attempt.process = f"rank-{ranks[0]}"
            proc = supervisor.procs.get(attempt.process)
            attempt.process_exit_code = None if proc is None else proc.poll()
    elif server_error and (name is None or is_server(name)
                           or not server_error.startswith(STOPPED)):
        attempt.error = server_error
    elif name is not None:
        said = "".join(f"; its last line: {line}" for line in supervisor.last_lines(name))
        if supervisor.kinds.get(name) == "command" and proc_code in NOT_STARTED:
            attempt.start_failure = True
            attempt.error = (f"{name} could not start: exit code {proc_code}, "
                             f"{NOT_STARTED[proc_code]} (see --python, --rsh){said}")
        else:
            attempt.error = f"exited with code {proc_code}{said}"
    else:
        attempt.error = supervisor.error or f"the launcher ended with code {code}"


def read_summary(out: Path) -> dict | None:
    try:
        return json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None


def keep_logs(out: Path, number: int) -> None:
    """Move this attempt's logs to logs/attempt-I/ before the next attempt writes its own."""
    logs = out / "logs"
    if not logs.is_dir():
        return
    folder = logs / f"attempt-{number}"
    folder.mkdir(exist_ok=True)
    for log in logs.glob("*.log"):
        log.replace(folder / log.name)


def drop_checkpoints(out: Path, shards: int) -> None:
    """Before starting again from the beginning: the incomplete checkpoints of the failed
    attempt, so that none of them can pair with the new attempt's files."""
    shard_dirs = [keyranges.shard_dir(out, i) for i in range(shards if shards > 1 else 0)]
    for d in [out, *shard_dirs]:
        shutil.rmtree(checkpoint.directory(d), ignore_errors=True)


def write_history(out: Path, attempts: list[Attempt], code: int, restarts_allowed: int) -> None:
    """summary.json's ``attempts`` (and ``restarts``) for a run that could restart or failed;
    for a failed run without a summary, the launcher's own with the last cause."""
    if code == 0 and not restarts_allowed:
        return
    summary = read_summary(out)
    if summary is None:
        if code == 0:
            return
        summary = {"status": "failed", "error": attempts[-1].describe(),
                   "written_by": "psparse-launch"}
    elif code != 0 and str(summary.get("error") or "").startswith(STOPPED) \
            and attempts[-1].error and not attempts[-1].error.startswith(STOPPED):
        summary["stopped_by"], summary["error"] = summary["error"], attempts[-1].describe()
    summary["restarts"] = len(attempts) - 1
    summary["attempts"] = [asdict(a) for a in attempts]
    write_json(out / SUMMARY_FILE, summary)


class Restarts:
    """The restart loop around one attempt: ``run(start)`` with ``start(plan) -> (code,
    supervisor)`` starting the plan once and watching it."""

    def __init__(self, plan, max_restarts: int, backoff_s: float = BACKOFF_S, say=print):
        self.plan, self.max_restarts, self.backoff_s = plan, max_restarts, backoff_s
        self.say = say
        self.attempts: list[Attempt] = []

    def run(self, start) -> int:
        plan = self.plan
        if plan.resume:
            problems = checkpoint.damaged(plan.out, plan.cfg.workers, plan.shards)
            if problems:
                return self._cannot_resume(problems)
        point = resume_point(plan.out, plan.cfg.workers, plan.shards) if plan.resume else None
        if point is not None:  # (without one, --resume fails in the server, saying why)
            self._resume_at(point)
        while True:
            attempt = Attempt(len(self.attempts), None if point is None else point.iteration,
                              time.time(),
                              ranks=plan.ranks)
            self.attempts.append(attempt)
            plan.attempt = attempt.number
            code, supervisor = start(plan)
            if code == 0:
                attempt.exit_code = 0
                break
            record_failure(attempt, plan.out, code, supervisor)
            if attempt.start_failure:
                print(f"psparse-launch: error: {attempt.describe()}", file=sys.stderr,
                      flush=True)
            if code == 130 or not self._again(attempt):
                break
            keep_logs(plan.out, attempt.number)
            problems = checkpoint.damaged(plan.out, plan.cfg.workers, plan.shards)
            if problems:
                self.say("psparse-launch: not restarting: the checkpoint to restart from is "
                         "damaged: " + "; ".join(problems))
                attempt.error = f"{attempt.error}; then the checkpoint to restart from was " \
                                f"damaged: {'; '.join(problems)}"
                break
            point = resume_point(plan.out, plan.cfg.workers, plan.shards)
            if point is None:
                drop_checkpoints(plan.out, plan.shards)
            where = "from the beginning (no checkpoint is complete yet)" if point is None \
                else f"from the checkpoint at iteration {point.iteration}" + (
                    f" with the ranks live then, {point.live}"
                    if len(point.live) < plan.cfg.workers else "")
            self.say(f"psparse-launch: restart {attempt.number + 1} of {self.max_restarts} in "
                     f"{self.backoff_s:g} s, {where}, after: {attempt.describe()}")
            time.sleep(self.backoff_s)
            self._resume_at(point)
        write_history(plan.out, self.attempts, code, self.max_restarts)
        return code

    def _cannot_resume(self, problems: list[str]) -> int:
        """--resume onto a damaged checkpoint: nothing starts; the run's summary says failed,
        naming each damaged file."""
        error = "cannot resume: " + "; ".join(problems)
        print(f"psparse-launch: error: {error}", file=sys.stderr, flush=True)
        summary = read_summary(self.plan.out) or {}
        summary.update(status="failed", error=error, written_by="psparse-launch")
        write_json(self.plan.out / SUMMARY_FILE, summary)
        return 1

    def _resume_at(self, point) -> None:
        """The next attempt resumes at ``point`` (None: starts from the beginning) with the
        workers live there: an elastic run's lost ranks stay out (plan.ranks)."""
        plan = self.plan
        plan.resume, plan.start = point is not None, 0 if point is None else point.iteration
        plan.ranks = None if point is None or len(point.live) == plan.cfg.workers \
            else point.live

    def _again(self, attempt: Attempt) -> bool:
        if attempt.start_failure and self.max_restarts:
            self.say("psparse-launch: the run could not start; not restarting it (it would "
                     f"not start again): {attempt.describe()}")
            return False
        if attempt.number >= self.max_restarts:
            if self.max_restarts:
                self.say(f"psparse-launch: no restart left ({self.max_restarts} used); the run "
                         f"failed: {attempt.describe()}")
            return False
        killed = -(attempt.process_exit_code or 0) in OUTSIDE_SIGNALS  # not a crash
        if len(self.attempts) > 1 and self.attempts[-2].cause() == attempt.cause() \
                and not killed:
            self.say("psparse-launch: the run failed again with the same cause at the same "
                     f"iteration; not restarting it: {attempt.describe()}")
            return False
        return True
