"""What a round does with a non-finite number: the loss, or an accumulator holding NaN or inf.

Under a GradScaler (fp16) either one is an *overflow*: the round sends nothing, the server flags
the iteration and every rank skips the step together (psparse.worker.amp). Without one the run
has *diverged*: the worker stops with a ``WorkerError`` that says so and what to change. Every
round (host, device, in parts) and the built-in loop take their errors from here, so each
message is written once.
"""

from __future__ import annotations

import math

from .client import WorkerError

SCALER_HINT = (
    "If this run trains in fp16 with a torch.amp.GradScaler, give the scaler to psparse "
    "(connect(..., scaler=scaler), psparse.ddp_hook.register(model, scaler=scaler), or "
    "exchange(loss, scaler=scaler)): an overflowed step is then skipped on every rank and the "
    "scale backs off; otherwise lower the learning rate")


def loss_diverged(it: int, value: float, remedy: str = "lower the learning rate, or use "
                  "clip_norm") -> WorkerError:
    """A non-finite loss without a GradScaler."""
    return WorkerError(f"training diverged at iteration {it}: loss is {value} ({remedy})")


def accumulator_diverged(it: int, what: str) -> WorkerError:
    """An accumulator (gradient + error feedback) holding NaN or inf without a GradScaler:
    ``what`` says what was found (the selection's complaint, or a count)."""
    return WorkerError(f"training diverged at iteration {it}: {what}. {SCALER_HINT}")


def read_loss(loss, it: int, scaling) -> tuple[float | None, bool]:
    """(the loss as a float or None, whether the step overflowed): a loss (tensor, number or
    None) read on the host; not finite, it is an overflow under a GradScaler (``scaling``, a
    psparse.worker.amp step) and a divergence without one."""
    if loss is None:
        return None, False
    value = float(loss.item() if hasattr(loss, "item") else loss)
    if math.isfinite(value):
        return value, False
    if scaling is not None:
        return None, True
    raise loss_diverged(it, value)


def require_scaler(ctx, it: int) -> None:
    """A round the server flagged as an overflow needs this worker's GradScaler, which skips
    the step with the others."""
    if ctx.scaling is None:
        raise WorkerError(f"the server flagged iteration {it} as an overflow, but this worker "
                          "has no GradScaler (connect(..., scaler=...))")
