"""The built-in loop's learning rate, iteration by iteration: --warmup-epochs, then
--lr-schedule (step: --lr-steps; cosine). docs/protocol.md's update rule states the same."""

from __future__ import annotations

import math

from ..config import RunConfig


def varies(cfg: RunConfig) -> bool:
    """Whether the loop sets the learning rate every iteration (else it stays --lr)."""
    return bool(cfg.lr_steps) or cfg.lr_schedule != "step" or cfg.warmup_epochs > 0


def learning_rate(cfg: RunConfig, it: int, batches_per_epoch: int, iterations: int) -> float:
    """The learning rate for iteration ``it`` (0-based) of ``iterations``: first a linear
    warm-up over W = --warmup-epochs x batches_per_epoch iterations, lr x min(1, (it + 1) / W)
    (so the first step is not wasted at 0; Goyal et al. 2017), then the step schedule at epoch
    it / batches_per_epoch (RunConfig.lr_at), or cosine from --lr at the warm-up's end to 0
    after the last iteration: lr x (1 + cos(pi (it - W) / (iterations - W))) / 2 (SGDR
    without restarts, Loshchilov and Hutter 2017)."""
    warm = cfg.warmup_epochs * batches_per_epoch
    if it < warm:
        return cfg.lr * min(1.0, (it + 1) / warm)
    if cfg.lr_schedule == "cosine":
        done = (it - warm) / max(1.0, iterations - warm)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
    return cfg.lr_at(it / batches_per_epoch)
