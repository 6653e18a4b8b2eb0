"""AdamW with its second moment frozen after a dense warm-up: 1-bit Adam's schedule (Tang et
al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed"; 0/1 Adam, Lu et al. 2022, refines when to freeze).

Why psparse needs it (docs/notes/adam-low-density.md): AdamW applied to sparse aggregates
divides each arrival by a variance that the mostly-zero aggregates keep small, so an entry that
arrives after T rounds of error feedback moves about the same as one that arrived every round.
Once the variance stops changing, AdamW's update is a fixed diagonal scaling of the momentum of
the aggregates -- linear in them -- so error feedback's conservation (everything computed is
applied, late) holds through the optimizer again. 1-bit Adam measured that the variance settles
early; the warm-up before the freeze is exchanged dense (``--dense-warmup``), so every replica
freezes the same variance, estimated from whole gradients.

    opt = FrozenVarianceAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, freeze_after=30)
    ps = psparse.connect(model, opt, dense_warmup=30, density=0.01, ...)

Before ``freeze_after`` steps it is ``torch.optim.AdamW(..., foreach=False)`` bit for bit
(tests/test_frozen_variance.py); after them the second moment and its bias correction stay as
they were at step ``freeze_after``.
"""

from __future__ import annotations

import torch


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose second moment ``exp_avg_sq`` is updated for the
    first ``freeze_after`` steps only (counted per parameter, as AdamW counts its steps, so a
    step the GradScaler skips is not counted)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, freeze_after: int):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        if not (isinstance(freeze_after, int) and freeze_after >= 1):
            raise ValueError("freeze_after must be a whole number of steps >= 1 (the variance "
                             f"needs at least one gradient), got {freeze_after!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, freeze_after=freeze_after))

    def load_state_dict(self, state_dict) -> None:
        """A state_dict of this optimizer, or of torch's AdamW (its groups have no
        ``freeze_after``: they take this optimizer's)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("freeze_after", self.defaults["freeze_after"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            freeze_after = group["freeze_after"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FrozenVarianceAdamW takes dense gradients (psparse "
                                       "writes the aggregate densely)")
                state = self.state[p]
                if not state:
                    # the step as a float tensor, as torch's AdamW keeps it (state_dict alike)
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                # torch.optim.AdamW's single-tensor arithmetic, in its order (bit-identical)
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                if step <= freeze_after:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** min(step, freeze_after)
                denom = (state["exp_avg_sq"].sqrt() / bias_correction2 ** 0.5).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)
        return loss
