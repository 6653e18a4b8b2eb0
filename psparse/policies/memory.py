"""Error-feedback memory: how gradients become the accumulator a policy selects from.

GRACE calls this the "memory" half of a compressor. Three kinds, all composable with any
selection policy:

* ``residual`` (default): acc += g. Entries not sent stay in acc and are sent later.
* ``dgc``: Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018):
  u = m*u + g; acc += u. After sending, both acc and u are zeroed at the sent indices
  (momentum factor masking), and the optimizer applies the aggregate with *plain* SGD,
  since momentum already happened locally.
* ``scalecom``: ScaleCom's low-pass-filtered memory (Chen et al., "ScaleCom: Scalable
  Sparsified Gradient Compression for Communication-Efficient Distributed Training", NeurIPS
  2020, Algorithm 1, its memory-update line). With m_t the worker's memory, g_t its gradient
  and s_t what it sends (p_t at the sent indices, zero elsewhere)::

      p_t     = m_t + g_t                          the error-feedback gradient (selected from)
      r_t     = p_t - s_t                          plain error feedback's next memory
      m_{t+1} = (1 - beta) * m_t + beta * r_t      a first-order low-pass filter over r_t
              = m_t + beta * (g_t - s_t)

  beta = 1 is plain error feedback (``residual``). A smaller beta smooths the memory over
  about 1/beta rounds, so the workers' memories, built from gradients of the same model,
  grow alike, and the leader's top-k (``cltk``, ScaleCom's cyclic local top-k) suits the
  other workers too. Two consequences of the update, both exact:

  - a sent entry is not zeroed: it keeps (1 - beta) * m_t[j] (the old memory, decayed), and
    an unsent one gains only beta * g_t[j];
  - nothing is lost, only delayed: summed from m_0 = 0, m_T = beta * sum_t (g_t - s_t), so
    **sum_t g_t = sum_t s_t + m_T / beta**. What a worker has computed equals what it has
    sent plus its memory divided by beta; the difference to plain error feedback's
    "sent + memory" is (1/beta - 1) * m_T, still to be sent (tests/test_memory_scalecom.py).
    No rescaling of the update is needed: over a run the aggregate carries the whole gradient.

  Source note: the search tools of this project reached the paper's abstract, the IBM
  summary and a NeurIPS review ("error feedback with low-pass filtering"), not its full
  text, so its equation numbers could not be checked. The update above is the memory line of
  the paper's Algorithm 1 as recalled, m_{t+1} = (1 - beta) m_t + beta (m_t + g_t - s_t):
  the only reading under which beta = 1 (no filtering) is ordinary error feedback. The other
  reading, m_{t+1} = (1 - beta) m_t + beta (g_t - s_t), would drop the unsent old memory at
  beta = 1 (no error feedback at all), so it is not used. The default beta = 0.1
  (``SCALECOM_BETA``) is the paper's large-batch setting as recalled, likewise unverified
  here; ``--memory-beta`` sets it. docs/policies.md lists what of the paper is and is not
  implemented.

* ``adam``: each worker's own Adam step, sent with error feedback (the remedy of issue 53 for
  adaptive optimizers at low density). With the worker's local gradient g and its own moments::

      m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2;   t += 1
      acc += (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)

  (torch.optim.Adam's step without the learning rate; b1, b2, eps = ``ADAM_BETAS``, Adam's
  defaults), and the optimizer applies the aggregate with plain SGD (lr, and weight decay, which
  for plain SGD is AdamW's decoupled decay). Adam applied to a sparse aggregate normalises
  every coordinate by a variance made of mostly-zero rounds, so an entry that arrives after
  many rounds of error feedback moves about as far as a dense step, whatever it carries
  (docs/notes/adam-low-density.md). Here the moments see every local gradient, dense, and what
  travels is the step itself, so nothing of it is lost, only delayed: sum of what was sent plus
  the accumulator equals the sum of the local Adam steps. The same idea as DGC's momentum
  correction (the momentum moves into the worker, before the compression), carried to Adam's
  second moment; 1-bit Adam (Tang et al., ICML 2021) and 0/1 Adam (Lu et al., ICLR 2023)
  compress Adam's momentum with error feedback after freezing a variance learned dense, which
  this keeps local and live instead. No factor masking: the momentum's later contributions are
  part of the dense Adam steps, and error feedback carries them.

Optional local gradient clipping scales g to L2 norm <= clip_norm before it is accumulated.
``density_schedule`` gives the DGC paper's four-fold density warm-up: 25%, 6.25%, 1.5625%, ...
per epoch over the first warm-up epochs, never below the target (DGC's released code
interpolates geometrically instead: docs/policies.md).
"""

from __future__ import annotations

import math

import numpy as np

from ..backends.host import HostBackend
from ..config import ADAM_BETAS, MEMORIES, SCALECOM_BETA  # noqa: F401 (the names live in config)
from ..ops.select.radix import ACC_DGC, ACC_FILTERED, ACC_RESIDUAL


class Memory:
    """The accumulator (and DGC velocity, ScaleCom's filtered memory, or the adam memory's
    moments) of one worker, where its backend keeps arrays: the host's
    (``psparse.backends.host``, numpy) or a device's (``dev``: then ``add`` takes the
    gradient as a CuPy view of the torch tensor). Each rule is written once; the backend does
    its steps (accumulate, take, clip) where the arrays are.

    ``accumulator`` is what the policy selects from: for ``residual`` and ``dgc`` it is also
    what carries over to the next round; for ``scalecom`` it is p_t = m_t + g_t during a round
    and scratch between rounds, and ``filtered`` (m_t) carries over."""

    def __init__(self, numel: int, kind: str = "residual", momentum: float = 0.9,
                 clip_norm: float | None = None, xp=np, beta: float = SCALECOM_BETA, dev=None):
        # dev: a device backend (psparse.backends.cuda), else None (the host's)
        self.backend = dev or HostBackend(xp)
        xp = self.backend.xp
        if kind not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, got {kind!r}")
        if kind == "scalecom" and not 0 < beta <= 1:
            raise ValueError(f"the scalecom memory's beta must be in (0, 1], got {beta!r}")
        self.kind, self.momentum, self.clip_norm, self.beta = kind, momentum, clip_norm, beta
        self.accumulator = xp.zeros(numel, dtype=xp.float32)
        self.velocity = xp.zeros(numel, dtype=xp.float32) if kind == "dgc" else None
        self.filtered = xp.zeros(numel, dtype=xp.float32) if kind == "scalecom" else None
        self.xp = xp
        if kind == "adam":  # the local Adam step's moments, and (b1^t, b2^t) where they live
            self.first = xp.zeros(numel, dtype=xp.float32)
            self.second = xp.zeros(numel, dtype=xp.float32)
            self.powers = xp.ones(2, dtype=xp.float64)
            # the step's two scratch vectors: the same buffers every round (no allocation)
            self._scratch = xp.empty(numel, dtype=xp.float32)
            self._step = xp.empty(numel, dtype=xp.float32)

    def add(self, grad: np.ndarray) -> np.ndarray:
        """Fold one local gradient in; returns the accumulator to select from."""
        return self.add_prepared(self.prepared(grad))

    def prepared(self, grad):
        """What the accumulator gains from ``grad``: the gradient clipped (``clipped``), and
        for ``adam`` the local Adam step taken with it (``adam_step``; once per round)."""
        return self.adam_step(self.clipped(grad))

    def add_prepared(self, grad):
        """``add`` of a gradient already ``prepared`` (the radix engine folds the same
        accumulation into its first pass where a device round lets it: ``accumulate_spec``)."""
        return self.backend.accumulate(*self.accumulate_spec(grad))

    def clipped(self, grad):
        """The gradient scaled to L2 norm <= clip_norm (unchanged without clipping); on a
        device the factor stays there (``Backend.clipped``)."""
        return grad if self.clip_norm is None else self.backend.clipped(grad, self.clip_norm)

    def adam_step(self, grad):
        """``adam``: the moments take ``grad``, and the local Adam step (what the accumulator
        gains) comes back; the gradient unchanged for the other memories. One implementation
        in array operations for the host and the device (``xp``: numpy or CuPy); on the device
        the bias corrections stay device scalars (nothing is read back)."""
        if self.kind != "adam":
            return grad
        xp, (b1, b2, eps) = self.xp, ADAM_BETAS
        first, second, powers = self.first, self.second, self.powers
        scratch, step = self._scratch, self._step
        powers[0:1] *= b1
        powers[1:2] *= b2
        first *= np.float32(b1)
        first += xp.multiply(grad, np.float32(1 - b1), out=scratch)
        second *= np.float32(b2)
        xp.multiply(grad, grad, out=scratch)
        scratch *= np.float32(1 - b2)
        second += scratch
        # torch.optim.Adam: (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps), its
        # multiply-add where torch lerps the first moment (the last bit may differ)
        corrections = (1.0 - powers).astype(xp.float32)
        xp.sqrt(second, out=scratch)
        scratch /= xp.sqrt(corrections[1:2])
        scratch += np.float32(eps)
        xp.divide(first, corrections[0:1], out=step)
        step /= scratch
        return step

    @property
    def replayable(self) -> bool:
        """The round's accumulation can be captured in a CUDA graph with the selection: not
        with clipping (a norm first) or ``adam`` (its step's temporaries first)."""
        return self.clip_norm is None and self.kind != "adam"

    def accumulate_spec(self, grad) -> tuple:
        """The device accumulation of ``grad`` as the radix engine folds it into its first pass
        (psparse/ops/select/radix.py: ``RadixSelect.run``); ``grad`` already ``prepared``."""
        if self.filtered is not None:
            return (ACC_FILTERED, self.accumulator, grad, None, self.filtered, 0.0)
        if self.velocity is not None:
            return (ACC_DGC, self.accumulator, grad, self.velocity, None, self.momentum)
        return (ACC_RESIDUAL, self.accumulator, grad, None, None, 0.0)

    def add_range(self, grad: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``add`` for the entries [lo, hi) alone (one bucket of layers, ``--overlap``), the
        same arithmetic per entry; returns the whole accumulator. Not for clipping (it needs
        the whole gradient's norm) or ``scalecom`` (its update covers the whole vector)."""
        if self.clip_norm is not None or self.filtered is not None or self.kind == "adam":
            raise ValueError("a gradient in buckets cannot be clipped or folded into the "
                             "scalecom or adam memory bucket by bucket")
        velocity = None if self.velocity is None else self.velocity[lo:hi]
        self.backend.accumulate(ACC_RESIDUAL if velocity is None else ACC_DGC,
                                self.accumulator[lo:hi], grad, velocity, None, self.momentum)
        return self.accumulator

    def take(self, indices):
        """Values at ``indices`` (to push), then zero them there (and the velocity, for DGC).

        For ``scalecom`` the zeroed accumulator is r_t, and the memory becomes
        m_{t+1} = (1 - beta) m_t + beta r_t (the accumulator is left as scratch)."""
        values = self.backend.take(self.accumulator, indices, self.velocity)
        self.after_take()
        return values

    def after_take(self) -> None:
        """What follows the gather-and-zero: for ``scalecom`` the filtered memory's update
        m_{t+1} = (1 - beta) m_t + beta r_t (r_t: the zeroed accumulator)."""
        if self.filtered is not None:
            self.filtered *= np.float32(1.0 - self.beta)
            self.accumulator *= np.float32(self.beta)
            self.filtered += self.accumulator

    def feed_back(self, indices: np.ndarray, error: np.ndarray) -> None:
        """What rounding took from the values just pushed at ``indices`` (value minus what the
        server decodes, ``--values``) goes back into the memory, as if it had not been sent:
        the accumulator gains it (``residual``, ``dgc``: the velocity stays masked), and for
        ``scalecom`` the filtered memory gains beta times it (r_t holds it, and m_{t+1} =
        (1 - beta) m_t + beta r_t). On the device the error is uploaded, one host-to-device
        copy per push (nothing is read back)."""
        if indices.size == 0:
            return
        # on a device: asynchronous, through pinned buffers (psparse.backends.cuda)
        indices = self.backend.upload("feedback-indices",
                                      np.ascontiguousarray(indices, dtype=np.int64))
        error = self.backend.upload("feedback-error", np.ascontiguousarray(error, np.float32))
        target, weight = self.feedback_target()
        target[indices] += weight * error  # one push's indices are distinct: no add.at

    def feedback_target(self):
        """Where ``feed_back`` adds the rounding error, and its weight: the accumulator (1:
        the product is exact) or, for ``scalecom``, the filtered memory (beta). The device's
        fused rounding (worker/device_values.py) asks here too."""
        if self.filtered is not None:
            return self.filtered, np.float32(self.beta)
        return self.accumulator, np.float32(1.0)

    @property
    def optimizer_momentum_applies(self) -> bool:
        """False for DGC and adam: the momentum is applied locally, so the optimizer must not
        add more (plain SGD)."""
        return self.velocity is None and self.kind != "adam"

    def state_dict(self) -> dict:
        """The arrays that carry over between rounds (checkpoints save them)."""
        if self.filtered is not None:  # the accumulator is rebuilt from m_t by the next add
            return {"filtered": self.filtered}
        state = {"accumulator": self.accumulator}
        if self.velocity is not None:
            state["velocity"] = self.velocity
        if self.kind == "adam":
            state.update(first=self.first, second=self.second, powers=self.powers)
        return state


def density_schedule(target: float, warmup_epochs: float, epoch: float) -> float:
    """The DGC paper's warm-up: 0.25^(e+1) in warm-up epoch e (25%, 6.25%, ...), never below
    ``target``."""
    if epoch >= warmup_epochs:
        return target
    return max(target, 0.25 ** (math.floor(epoch) + 1))
