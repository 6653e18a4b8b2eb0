"""Mixed precision through the exchange: a GradScaler's unscaling and an overflowed step's skip.

Mixed precision through the exchange: a ``torch.amp.GradScaler``'s scaled gradients
(docs/api.md, "Mixed precision"; the wire side is docs/protocol.md, Overflow).

``torch.autocast`` (bf16 or fp16) needs nothing here: parameters stay float32, so their
gradients are float32 and the exchange is the ordinary one. A ``GradScaler`` multiplies the
loss, hence every gradient, by its scale S, and skips the optimizer step when a gradient is not
finite (then halves S). With psparse the skip must be the same on every rank, or the replicas
part: ``ps.exchange(loss, scaler=scaler)`` therefore

1. unscales the gradient (× 1/S, the scaler's own factor) before error feedback, so the
   accumulator, the selection and the wire only ever see unscaled values;
2. on a worker whose unscaled gradient (or loss) is not finite, adds nothing to the
   accumulator and pushes nothing, with the push's ``overflow`` flag; the server ORs the flags
   of a round into its aggregate, so every worker learns of it in the same round;
3. on an aggregate without the flag: applies it as always, then multiplies ``.grad`` by S, so
   that ``scaler.step(optimizer)`` (which unscales, × 1/S: exact for the scaler's powers of
   two) applies exactly the aggregate and ``scaler.update()`` grows S alike on every rank;
4. on an aggregate with the flag (every worker sees the same): restores each worker's
   error-feedback memory to what it held before the step, lets the policy observe nothing,
   and fills ``.grad`` with inf, so every rank's ``scaler.step`` skips and its ``update``
   backs S off the same way. The step's gradients are dropped on every rank, as a GradScaler
   drops a skipped step's gradients without psparse (and under DDP, where the inf travels in
   the allreduce).

Each step with a scaler keeps one copy of the memory's state (the accumulator, and the DGC
velocity or ScaleCom's filtered memory) to restore it from.
"""

from __future__ import annotations

import numpy as np

from .client import WorkerError

__all__ = ["GradScaling", "scaling_for"]


def scaling_for(scaler, optimizer, previous=None):
    """The exchange's handling of ``scaler`` for one step (None: no scaler, or a disabled one:
    the exchange is the ordinary one); ``previous``: the last step's, whose buffers are
    reused."""
    if scaler is None or not scaler.is_enabled():
        return None
    if _already_unscaled(scaler, optimizer):
        raise WorkerError("scaler.unscale_(optimizer) was called before exchange(): the "
                          "exchange unscales the gradients itself (and scaler.step would then "
                          "apply the aggregate still scaled); drop the unscale_ call, and use "
                          "the clip_norm option instead of clipping in the loop")
    scaling = previous if previous is not None else GradScaling()
    scaling.step_at(float(scaler.get_scale()))
    return scaling


def _already_unscaled(scaler, optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran this step (the scaler's per-optimizer stage;
    torch keeps it in a private table, read defensively)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if optimizer is None or not isinstance(states, dict) or id(optimizer) not in states:
        return False
    stage = states[id(optimizer)].get("stage")
    return getattr(stage, "name", "") == "UNSCALED"


class GradScaling:
    """One step's scale S: unscale and check the gradient, remember the memory, and leave
    ``.grad`` as ``scaler.step`` expects it (the aggregate × S, or inf on a skipped step)."""

    def __init__(self):
        self.scale = self.inv_scale = 1.0
        self.saved: dict | None = None  # the memory before the step (kept between steps)

    def step_at(self, scale: float) -> None:
        """This step's scale S."""
        self.scale = scale
        # the factor GradScaler.unscale_ multiplies by: 1/S in double, rounded to float32
        self.inv_scale = float(np.float32(1.0 / scale))

    def save(self, memory) -> None:
        """Keep the memory's state as it is before the step (restored if the step is skipped),
        into the same buffers every step (host or device arrays: a copy on the device stays
        there)."""
        state = memory.state_dict()
        if self.saved is None or {n: a.shape for n, a in self.saved.items()} != \
                {n: a.shape for n, a in state.items()}:
            self.saved = {name: a.copy() for name, a in state.items()}
            return
        for name, a in state.items():
            self.saved[name][...] = a

    def restore(self, memory) -> None:
        """The memory as it was before the step."""
        for name, saved in self.saved.items():
            getattr(memory, name)[...] = saved

    def unscale(self, grad: np.ndarray) -> bool:
        """Unscale a host gradient (the flat one, or one part's range) in place; True when it
        is not finite (this worker overflowed). A GPU round unscales on its stream
        (psparse.worker.device_round); a CUDA worker without CuPy unscales its pinned host copy
        (its device .grad stays scaled, and is overwritten by the aggregate or the skip's inf
        before anything reads it)."""
        grad *= np.float32(self.inv_scale)
        return not bool(np.isfinite(grad).all())

    @staticmethod
    def poison(net) -> None:
        """``.grad`` all inf, so that ``scaler.step`` skips and ``scaler.update`` backs off."""
        for p, view in zip(net.parameters, net.grad_views):
            p.grad = view
        net.grad.fill_(float("inf"))

    def rescale(self, net) -> None:
        """The aggregate is in ``.grad``: × S, which ``scaler.step``'s unscale undoes."""
        net.grad.mul_(self.scale)
