"""A session's life as a training loop sees it: the run's length, ``stop()``, the misuses it names.

A session's life as the user's loop sees it: how long the run is (a fixed number of
iterations, or open-ended until a rank asks to stop), and the misuses a loop can make that
would otherwise fail far from their cause (docs/api.md, "The end of a run").

``RunLength`` answers "is another exchange due?" (``ps.running``) and refuses an exchange or a
close at the wrong moment, naming the fix. A stop request (``ps.stop()``) travels with the
rank's next push; the server marks that round's aggregate, so every rank learns in the same
iteration that it was the last one (docs/protocol.md, Stopping).

``end_of_script`` is what runs when a training script ends (psparse-launch calls it after the
script, an ``atexit`` hook otherwise): a session the script left open is reported to the server
as this worker's failure, with the cause (the script's exception) or, for a script that just
forgot, a message naming ``close()`` and the ``with`` form, so summary.json says what to fix
instead of "its connection closed". A session of the DDP comm hook (``auto_close``: a DDP
script has no psparse call but ``register``) is closed there instead, when the script ended
without an exception: a finished run, or an open-ended one, which the server ends once every
rank has closed after the same round.
"""

from __future__ import annotations

import atexit
import contextlib
import sys

from .client import WorkerError

__all__ = ["LoopControl", "RunLength", "end_of_script"]

CLOSE_FIX = ("end training with ps.close(...) (it sends the final report the server waits "
             "for), or run the loop inside `with psparse.connect(...) as ps:`, which closes a "
             "finished run")


class RunLength:
    """The run's length (``iterations``; None: open-ended) and where a stop request ended it
    (``stopped_at``: the last iteration, the one whose round carried the request)."""

    def __init__(self, iterations: int | None):
        self.iterations = iterations or None
        self.stopped_at: int | None = None

    def running(self, next_iteration: int) -> bool:
        """Whether another exchange is due."""
        return self.stopped_at is None and (self.iterations is None
                                            or next_iteration < self.iterations)

    def note(self, agg, it: int) -> None:
        """An aggregate that says a rank asked to stop: iteration ``it`` was the last."""
        if agg.get("stop"):
            self.stopped_at = it

    def check_close_ok(self, done: int) -> bool:
        """Whether ``check_close`` would pass."""
        return self.iterations is None or not self.running(done)

    def check_round(self, it: int) -> None:
        """An exchange for iteration ``it`` is within the run."""
        if self.stopped_at is not None:
            raise WorkerError(f"exchange() after the run ended: a stop request made iteration "
                              f"{self.stopped_at} the last (leave the loop once ps.running is "
                              "False)")
        if self.iterations is not None and it >= self.iterations:
            raise WorkerError(f"exchange() after the run's last iteration ({self.iterations} "
                              "iterations agreed at connect; leave the loop once ps.running "
                              "is False)")

    def where(self, done: int) -> str:
        """Where a run still going is, for messages: "after 12 of 40 iterations"."""
        if self.iterations is None:
            return f"after {done} iterations of an open-ended run (no ps.stop() yet)"
        return f"after {done} of {self.iterations} iterations"

    def check_close(self, done: int) -> None:
        """A close is due: the run is over, or open-ended (then this rank's last round is
        ``done - 1``, and the server ends the run once every rank has closed after that same
        round; a rank that pushes another is named: docs/protocol.md, Stopping)."""
        if self.iterations is not None and self.running(done):
            raise WorkerError(f"close() {self.where(done)}: every rank must make the same "
                              "exchanges; end the run with ps.stop() (the round it goes "
                              "with is every rank's last) or run all the iterations agreed "
                              "at connect")


class LoopControl:
    """What a ``Session`` offers a loop about its run's course: ``running``, ``stop()``,
    ``accumulating()`` (it holds ``length``, ``iteration``, ``client``, ``parts`` and
    ``_accumulating``)."""

    @property
    def running(self) -> bool:
        """Whether another exchange is due: the run is neither at its length nor stopped."""
        return self.length.running(self.iteration)

    def stop(self) -> None:
        """Ask to end the run (any rank, e.g. early stopping on the evaluator's accuracy): the
        request goes with this rank's next push, and that round is every rank's last; then
        ``running`` is False everywhere and ``close()`` ends the run with status ok."""
        self.client.request_stop()

    @contextlib.contextmanager
    def accumulating(self):
        """Gradient accumulation: backward passes inside the block only add to ``.grad``
        (with overlap, its hooks push nothing); the last micro-batch's backward, after the
        block, is exchanged with them by the next ``exchange()``::

            with ps.accumulating():
                for x, y in micro_batches[:-1]:
                    (loss_fn(model(x), y) / n).backward()
            (loss_fn(model(x_last), y_last) / n).backward()
            ps.exchange(loss)
        """
        if self.parts is not None and self.parts.in_round:
            raise WorkerError("ps.accumulating() after a backward pass of this round: with "
                              "overlap its buckets are sent already; enter it first")
        self._accumulating = True
        if self.parts is not None:
            self.parts.accumulating = True
        try:
            yield self
        finally:
            self._accumulating = False
            if self.parts is not None:
                self.parts.accumulating = False


def missing_backward(it: int) -> WorkerError:
    return WorkerError(
        f"exchange() at iteration {it} without a backward pass since the last exchange(): "
        "the parameters' .grad still hold the previous aggregate, which would be sent again "
        "as a gradient. Call loss.backward() before every ps.exchange() (several backward "
        "passes before one exchange() accumulate micro-batches)")


# ------------------------------------------------------------------- sessions left open
_open: list = []  # this process's sessions that registered and are not closed yet
_hooked = False


def opened(session) -> None:
    """A session registered: watch for a script that ends without closing it."""
    global _hooked
    _open.append(session)
    if not _hooked:
        atexit.register(_at_exit)
        _hooked = True


def closed(session) -> None:
    if session in _open:
        _open.remove(session)


def end_of_script(cause: BaseException | str | None = None) -> str | None:
    """The training script has ended: every session it left open reports its failure to the
    server (``cause``: the script's exception or exit, when it had one) and disconnects.
    Returns the message for a script that ended normally without closing, else None."""
    problems = []
    for session in list(_open):
        if session.closed:
            closed(session)
            continue
        if cause is None and session.auto_close and session.length.check_close_ok(
                session.iteration):
            try:
                session.close()  # a DDP script's end (psparse.ddp_hook): its last round
            except Exception as exc:  # the server refused the end (a rank pushed on)
                problems.append(str(exc))
                session.fail(exc)
            continue
        if cause is None:
            finished = not session.running
            problems.append(
                ("the script ended without ps.close() after the run's last iteration: "
                 if finished else
                 f"the script ended {session.length.where(session.iteration)} without "
                 "ps.close(): ") + CLOSE_FIX)
            session.fail(WorkerError(problems[-1]))
        else:
            session.fail(cause if isinstance(cause, BaseException) else WorkerError(cause))
    return "\n".join(problems) or None


def _at_exit() -> None:  # a script run as `python train.py` (torchrun, srun, by hand)
    cause = getattr(sys, "last_value", None)  # the uncaught exception, if the script died
    problem = end_of_script(cause)
    if problem:
        print(f"psparse: error: {problem}", file=sys.stderr, flush=True)
