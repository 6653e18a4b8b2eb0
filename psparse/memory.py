"""Error-feedback memory: how gradients become the accumulator a policy selects from.

GRACE calls this the "memory" half of a compressor. Two kinds, both composable with any
selection policy:

* ``residual`` (default): acc += g. Entries not sent stay in acc and are sent later.
* ``dgc``: Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018):
  u = m*u + g; acc += u. After sending, both acc and u are zeroed at the sent indices
  (momentum factor masking), and the optimizer applies the aggregate with *plain* SGD,
  since momentum already happened locally.

Optional local gradient clipping scales g to L2 norm <= clip_norm before it is accumulated.
``density_schedule`` gives DGC's warm-up: density 25%, 6.25%, 1.5625%, ... per epoch over the
first warm-up epochs, never below the target.
"""

from __future__ import annotations

import math

import numpy as np

from . import kernels
from .xp import array_module

MEMORIES = ("residual", "dgc")


class Memory:
    """The accumulator (and DGC velocity) of one worker, on the host (``xp=numpy``) or the GPU
    (``xp=cupy``: then ``add`` takes the gradient as a CuPy view of the torch tensor)."""

    def __init__(self, numel: int, kind: str = "residual", momentum: float = 0.9,
                 clip_norm: float | None = None, xp=np):
        if kind not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, got {kind!r}")
        self.kind, self.momentum, self.clip_norm = kind, momentum, clip_norm
        self.accumulator = xp.zeros(numel, dtype=xp.float32)
        self.velocity = xp.zeros(numel, dtype=xp.float32) if kind == "dgc" else None

    def add(self, grad: np.ndarray) -> np.ndarray:
        """Fold one local gradient in; returns the accumulator to select from."""
        if self.clip_norm is not None:
            norm = float(array_module(grad).linalg.norm(grad))
            if norm > self.clip_norm:
                grad = grad * np.float32(self.clip_norm / norm)
        return kernels.accumulate(self.accumulator, grad, self.velocity, self.momentum)

    def take(self, indices):
        """Values at ``indices`` (to push), then zero them there (and the velocity, for DGC)."""
        return kernels.take(self.accumulator, indices, self.velocity)

    @property
    def optimizer_momentum_applies(self) -> bool:
        """False for DGC: momentum is applied locally, so the optimizer must not add more."""
        return self.velocity is None

    def state_dict(self) -> dict:
        state = {"accumulator": self.accumulator}
        if self.velocity is not None:
            state["velocity"] = self.velocity
        return state


def density_schedule(target: float, warmup_epochs: float, epoch: float) -> float:
    """DGC warm-up: 0.25^(e+1) in warm-up epoch e (25%, 6.25%, ...), never below ``target``."""
    if epoch >= warmup_epochs:
        return target
    return max(target, 0.25 ** (math.floor(epoch) + 1))
