"""``psparse.connect``: join a run from any training script and get its ``Session``.

``psparse.connect``: join a run from any training script (the launcher's, torchrun's or one's
own environment) and get its ``Session``: where the rank, the world size, the server, the run
directory and the options come from."""

from __future__ import annotations

import math
import os
from dataclasses import fields, replace
from pathlib import Path

import torch

from ..config import LAUNCHER_OPTIONS, ConfigError, RunConfig
from ..options import config_from_json, load_config_file
from . import environment
from .client import report_failure
from .session import Session, failure_cause

__all__ = ["connect"]


def connect(model: torch.nn.Module, optimizer=None, *,
            iterations: int | None = None, batches_per_epoch: int | None = None,
            server: str | None = None, rank: int | None = None, world_size: int | None = None,
            out: str | Path | None = None, run_token: str | None = None,
            resume: bool | None = None, scaler=None, **options) -> Session:
    """Join a psparse run with ``model``: register with the server and return the Session.
    ``optimizer``: one, a list of them (saved together in checkpoints), or None (the loop
    applies ``p.grad`` itself). ``scaler``: the ``torch.amp.GradScaler`` of an fp16 loop
    (needed here with ``--overlap``, whose buckets leave during backward; otherwise
    ``exchange(loss, scaler=scaler)`` does too).

    Where things come from (first found wins):

    - ``rank`` / ``world_size``: the arguments, else ``RANK`` / ``WORLD_SIZE`` (psparse-launch,
      torchrun, SLURM, PMI and Open MPI variables);
    - ``server`` ("host:port"): the argument, else ``PSPARSE_SERVER``, else
      ``MASTER_ADDR``:``PSPARSE_PORT``;
    - options (``policy``, ``density``, ``granularity``, ``memory``, ``policy_args``,
      ``clip_norm``, ``density_warmup``, ``dense_warmup``, ``check_every``, ``checkpoint_every``, ``timeout``,
      ``curve_keys``, ...; the fields of docs/cli.md's run configuration): keyword arguments, else
      the launcher's run configuration (``PSPARSE_CONFIG``, its config.json), else defaults;
    - ``iterations``: the argument, else the configuration's ``iterations``, else its
      ``epochs`` × ``batches_per_epoch``, else (and with ``iterations=0``) open-ended: the run
      goes on until a rank calls ``stop()``;
    - ``out`` (the run directory, for rank-R.json and checkpoints): the argument, else
      ``PSPARSE_OUT``; ``run_token``: the argument, else ``PSPARSE_TOKEN``; ``resume``: the
      argument, else ``PSPARSE_RESUME=1`` (psparse-launch --resume).

    Every rank must call it with the same model architecture and options (the server compares
    them and names the first difference). The initial weights must match too: seed torch the
    same on every rank before building the model, or load the same weights.
    """
    if rank is None:
        rank = environment.rank_from_env()
        if rank is None:
            raise ConfigError("psparse.connect: no rank (pass rank=..., or run under "
                              "psparse-launch / torchrun, which set RANK)")
    address = server or environment.server_from_env() or "127.0.0.1:5555"
    try:
        servers = environment.parse_servers(address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_token = run_token or os.environ.get("PSPARSE_TOKEN") or None
    cfg = None
    try:
        cfg = _resolve_options(options, world_size)
        session = _open_session(model, optimizer, cfg, rank, servers, iterations,
                                batches_per_epoch, out, run_token, resume, scaler)
    except Exception as exc:  # not registered: tell the server why, for summary.json
        world = cfg.workers if cfg else world_size or environment.world_size_from_env()
        if world is not None:
            report_failure(servers, rank, world, failure_cause(exc), run_token=run_token,
                           curve_keys=cfg.curve_keys if cfg else options.get("curve_keys"))
        raise
    try:
        session.register()
    except BaseException as exc:
        session.fail(exc)
        raise
    return session



def _open_session(model, optimizer, cfg: RunConfig, rank: int, servers: list, iterations,
                  batches_per_epoch, out, run_token, resume, scaler=None) -> Session:
    """The Session, not registered yet; the length, run directory and resume flag from the
    arguments, else the configuration and the environment."""
    if iterations is None:
        iterations = _run_length(cfg, batches_per_epoch)
    if out is None and os.environ.get("PSPARSE_OUT"):
        out = os.environ["PSPARSE_OUT"]
    if resume is None:
        resume = os.environ.get("PSPARSE_RESUME") == "1"
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return Session(model, optimizer, cfg, rank=rank,
                   server=servers if len(servers) > 1 else servers[0], iterations=iterations,
                   batches_per_epoch=batches_per_epoch, out_dir=out, run_token=run_token,
                   resume=resume, scaler=scaler)


def _run_length(cfg: RunConfig, batches_per_epoch: int | None) -> int:
    """The run's iterations when connect() was not told: the configuration's, else its epochs
    (when the configuration gives them: --epochs, a config file, connect(epochs=...)) of
    ``batches_per_epoch``, else 0: open-ended (until a rank calls ``stop()``, or every rank
    closes after the same round). ``batches_per_epoch`` alone sets no length: it numbers the
    epochs (checkpoints, --lr-steps, eval.jsonl). With ``local_steps`` H an iteration is a
    synchronisation of H batches."""
    if cfg.iterations is not None:
        return cfg.iterations
    if batches_per_epoch and cfg.epochs is not None:  # local steps: H batches a synchronisation
        return math.ceil(cfg.epochs * batches_per_epoch / cfg.local_steps)
    return 0


def _resolve_options(options: dict, world_size: int | None) -> RunConfig:
    """Defaults, then the launcher's config.json (PSPARSE_CONFIG), then keyword options."""
    values = {}
    launched = os.environ.get("PSPARSE_CONFIG") or os.environ.get("PSPARSE_CONFIG_JSON")
    if os.environ.get("PSPARSE_CONFIG"):  # the launcher's config.json (same host)
        values.update(load_config_file(Path(os.environ["PSPARSE_CONFIG"])))
    elif os.environ.get("PSPARSE_CONFIG_JSON"):  # the same, inline (cluster modes)
        values.update(config_from_json(os.environ["PSPARSE_CONFIG_JSON"], "PSPARSE_CONFIG_JSON"))
    known = {f.name for f in fields(RunConfig)}
    shared = sorted(set(options) & set(LAUNCHER_OPTIONS))
    if shared:
        raise ConfigError(f"psparse.connect: {', '.join(shared)} must match the server's: set "
                          "it on psparse-launch (or psparse-server), not in connect()")
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"psparse.connect: unknown option {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(known - set(LAUNCHER_OPTIONS)))}")
    if isinstance(options.get("policy_args"), dict):
        options["policy_args"] = [f"{k}={v}" for k, v in options["policy_args"].items()]
    values.update(options)
    if world_size is not None:
        values["workers"] = world_size
    elif not launched:
        env_world = environment.world_size_from_env()
        if env_world is None:
            raise ConfigError("psparse.connect: no world size (pass world_size=..., or run "
                              "under psparse-launch / torchrun, which set WORLD_SIZE)")
        values["workers"] = env_world
    return replace(RunConfig(), **values).validate()
