"""What a worker checks before it registers: the options it can honour, the model, and the
optimizer against the memory (each a ConfigError naming the problem and what to do)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..policies.memory import Memory


def check_options(cfg: RunConfig, batches_per_epoch: int | None, on_device: bool) -> None:
    """Options this worker cannot honour, named before it registers."""
    if cfg.density_warmup and not batches_per_epoch:
        raise ConfigError("density_warmup needs the epoch length: connect(..., "
                          "batches_per_epoch=len(loader))")
    if cfg.record_selections and on_device:
        raise ConfigError("--record-selections reads the whole gradient and accumulator "
                          "back every round: it runs on the host path (--device cpu, or "
                          "without CuPy)")
    if cfg.probe_recall and (on_device or cfg.overlap or cfg.bucket_mb is not None):
        raise ConfigError("--probe-recall reads the whole accumulator at one point of the "
                          "round: it runs on the host path in one round per iteration "
                          "(--device cpu, without --bucket-mb / --overlap)")


def check_model(model: torch.nn.Module) -> None:
    """Trainable parameters must be float32 and on one device (clear errors otherwise)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    bad = [f"{n} ({p.dtype})" for n, p in params if p.dtype != torch.float32]
    if bad:
        raise ConfigError("psparse exchanges float32 parameters; convert the model with "
                          f".float() (not float32: {', '.join(bad[:5])}"
                          f"{', ...' if len(bad) > 5 else ''})")
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices ({devices}); "
                          "psparse needs them on one")


def check_optimizer(optimizer, memory: Memory, cfg: RunConfig, out_dir: Path | None) -> None:
    """The optimizer fits the memory (``dgc`` applies momentum itself) and checkpoints have a
    run directory and an optimizer to save."""
    sparse_only = [type(o).__name__ for o in getattr(optimizer, "members", [optimizer])
                   if isinstance(o, torch.optim.SparseAdam)]
    if sparse_only:
        raise ConfigError(f"{sparse_only[0]} takes sparse gradients only, and psparse writes the "
                          "aggregate into .grad as a dense tensor (its zeros are the entries no "
                          "worker sent): use torch.optim.Adam or AdamW; nn.Embedding(sparse="
                          "True) can stay, its sparse gradient is made dense for the exchange")
    if optimizer is not None and not memory.optimizer_momentum_applies and not (
            all(isinstance(o, torch.optim.SGD) for o in getattr(optimizer, "members",
                                                                 [optimizer]))
            and not any(g.get("momentum", 0) for g in optimizer.param_groups)):
        raise ConfigError(f"memory {memory.kind!r} applies "
                          f"{'Adam' if memory.kind == 'adam' else 'momentum'} in the "
                          "accumulator: the optimizer must be plain SGD (torch.optim.SGD with "
                          f"momentum=0, the learning rate and weight decay yours), got "
                          f"{type(optimizer).__name__}")
    if cfg.checkpoint_every and (out_dir is None or optimizer is None):
        raise ConfigError("checkpoints (--checkpoint-every) need the run directory (out= or "
                          "PSPARSE_OUT) and the optimizer: connect(model, optimizer, ...)")
