"""Local steps (``--local-steps H``): H optimizer steps on a worker's own data, then one
synchronisation that exchanges the pseudo-gradient and applies the aggregate with an outer step.

DiLoCo's algorithm (Douillard et al. 2023) with psparse's exchange in the middle. Between two
synchronisations every worker steps its own optimizer (the *inner* one: the user's) on its own
gradients. At the synchronisation (``sync``):

1. the pseudo-gradient ``Δ = θ_sync − θ`` (how far the local steps moved the weights) is
   written into ``.grad`` and the weights go back to ``θ_sync``, which every rank holds alike;
2. the session's round exchanges ``Δ`` exactly as it exchanges a gradient: error-feedback
   accumulator, selection policy, ``--values``, shards, checksums (of ``θ_sync``: the same on
   every rank), and writes the aggregate ``Δ̄`` (the mean at the union of the pushed entries)
   into ``.grad``;
3. the outer step, SGD with Nesterov momentum as torch.optim.SGD computes it:
   ``b = μ b + Δ̄``, ``θ_sync ← θ_sync − η_out (Δ̄ + μ b)`` (``μ = 0``: ``θ_sync − η_out Δ̄``).

Every rank applies the same aggregate to the same ``θ_sync`` with the same momentum, so the
weights are bit-identical after every synchronisation; the inner optimizer's state (Adam's
moments, SGD's momentum) stays each worker's own, as in DiLoCo. The outer momentum ``b`` is part
of the worker's checkpoint, which is written at a synchronisation (psparse/worker/session_state.py).
"""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..option_rules import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from .flat_model import FlatModel


def outer_step_options(cfg: RunConfig) -> tuple[float, float]:
    """(learning rate, Nesterov momentum) of the outer step: the options, else DiLoCo's."""
    return (DILOCO_OUTER_LR if cfg.outer_lr is None else cfg.outer_lr,
            DILOCO_OUTER_MOMENTUM if cfg.outer_momentum is None else cfg.outer_momentum)


class LocalSteps:
    """One worker's local-steps state: the weights at the last synchronisation (``anchor``),
    the outer step's momentum, and the count and losses of the local steps since."""

    def __init__(self, net: FlatModel, cfg: RunConfig):
        self.net, self.steps = net, cfg.local_steps
        self.lr, self.momentum = outer_step_options(cfg)
        self.anchor = net.params.detach().clone()
        self.velocity = torch.zeros_like(net.params)  # b: the outer step's momentum buffer
        self.taken = 0  # local steps since the last synchronisation
        self._loss_sum = None  # their losses, summed on the device (no read per step)

    def note_step(self, loss) -> bool:
        """One local step done (``loss``: its loss, or None); whether a synchronisation is due."""
        self.taken += 1
        if loss is not None:
            loss = loss.detach().float() if torch.is_tensor(loss) else float(loss)
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        return self.taken >= self.steps

    def pseudo_gradient(self):
        """Step 1: ``Δ = θ_sync − θ`` into ``.grad``, the weights back to ``θ_sync``; returns the
        mean loss of the local steps (None if none was given) for the round's metrics."""
        net = self.net
        for p, view in zip(net.parameters, net.grad_views):
            p.grad = view  # a loop that set .grad to None (zero_grad()) gets the views back
        with torch.no_grad():
            torch.sub(self.anchor, net.params, out=net.grad)
            net.params.copy_(self.anchor)
        loss = None if self._loss_sum is None else self._loss_sum / self.taken
        self.taken, self._loss_sum = 0, None
        return loss

    @torch.no_grad()
    def outer_step(self) -> None:
        """Step 3: the aggregate pseudo-gradient in ``.grad`` applied to ``θ_sync`` (torch SGD's
        Nesterov arithmetic, in its order), which becomes the next ``θ_sync``."""
        aggregate, params = self.net.grad, self.net.params
        if self.momentum:
            self.velocity.mul_(self.momentum).add_(aggregate)
            params.add_(aggregate.add(self.velocity, alpha=self.momentum), alpha=-self.lr)
        else:
            params.add_(aggregate, alpha=-self.lr)
        self.anchor.copy_(params)

    def state_dict(self) -> dict:
        return {"velocity": self.velocity.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's outer momentum; the anchor is the restored weights (a checkpoint is
        written at a synchronisation, where ``θ = θ_sync``)."""
        self.velocity.copy_(state["velocity"])
        self.anchor.copy_(self.net.params)
        self.taken, self._loss_sum = 0, None
