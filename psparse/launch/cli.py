"""``psparse-launch``: one run (server shards and N workers) from one command line.

Parses the flags (the run's options, psparse/config.py, plus where the processes go), checks the
policy and any plug-in before anything starts, writes RUN_DIR/config.json (the resolved options
every process reads, and which code made the run), then starts the plan (plan.py) under the
supervisor (supervisor.py) with the progress line and summary table (progress.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from .. import plugin
from ..config import ConfigError, RunConfig
from ..ops import jit
from ..options import add_config_arguments, resolve_config
from ..policies import Layout, PolicyError, build_policy, policy_class
from ..provenance import provenance
from ..rundir import (
    EVAL_FILE,
    METRICS_FILE,
    PORT_FILE,
    SUMMARY_FILE,
    TIMING_FILE,
    clear_run_dir,
    complete_run,
    held_run,
    open_truncated,
    write_atomic,
)
from ..server.records import merge_run_dir
from ..wire import keyranges
from . import cluster
from .plan import Plan, StartFailure, Topology
from .processes import free_port, port_taken
from .progress import Progress
from .restart import BACKOFF_S, Restarts
from .supervisor import Supervisor
from .tensorboard import RunBoard

DEFAULT_CHECKPOINT_EVERY = 100  # iterations, where --max-restarts finds no --checkpoint-every


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psparse-launch",
        description="Train with a psparse parameter server and N workers on this host (or a "
                    "cluster: --hostfile, --slurm). Example: psparse-launch --workers 8 "
                    "--density 0.01 --epochs 2 --out runs/x")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory (default: runs/<model>-<dataset>-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in --out even if it holds another run's files "
                        "(they are deleted first); without it such an --out is refused")
    p.add_argument("--quiet", action="store_true", help="no progress line or summary table")
    _add_cluster_arguments(p)
    p.add_argument("--baseline", choices=["ddp", "fp16", "bf16", "powersgd"], default=None,
                   help="train the same run with torch DistributedDataParallel (dense ring "
                        "allreduce, gloo on CPU / NCCL on GPU) instead of psparse, for "
                        "comparison; fp16 / bf16: DDP with its fp16_compress_hook / "
                        "bf16_compress_hook (the ring in 2-byte floats); powersgd: DDP with the "
                        "PowerSGD comm hook (error feedback, warm start, a dense warm-up)")
    p.add_argument("--powersgd-rank", type=int, default=4, metavar="R",
                   help="with --baseline powersgd: the rank of PowerSGD's low-rank "
                        "approximation (default 4)")
    p.add_argument("--powersgd-warmup", type=int, default=1000, metavar="ITERS",
                   help="with --baseline powersgd: dense allreduce for the first ITERS "
                        "iterations (torch's start_powerSGD_iter; default 1000, torch's "
                        "own; at least 2)")
    p.add_argument("--master-addr", default=None,
                   help="with --baseline and --hostfile: the address of rank 0's host, where "
                        "the DDP ranks meet (port --port; default: that host's name)")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="the run's admission secret, given to the server and every worker in "
                        "PSPARSE_TOKEN (default: $PSPARSE_TOKEN, else a fresh random one per "
                        "run)")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR (its config.json) from the newest checkpoint that the "
                        "server and all workers saved (see --checkpoint-every)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="when any process fails or is lost, stop the rest and start the whole "
                        "run again from the newest checkpoint every process saved, up to R "
                        "times (not again when it fails with the same cause at the same "
                        "iteration); implies --checkpoint-every "
                        f"{DEFAULT_CHECKPOINT_EVERY} unless given (default 0: no restart)")
    p.add_argument("--restart-backoff", type=float, default=BACKOFF_S, metavar="SECONDS",
                   help=f"with --max-restarts: the wait before a restart (default {BACKOFF_S:g})")
    add_config_arguments(p)
    p.add_argument("script", nargs="?", default=None, metavar="TRAIN.PY",
                   help="your own training script (it calls psparse.connect), started once per "
                        "worker with RANK, WORLD_SIZE, LOCAL_RANK, PSPARSE_SERVER, PSPARSE_OUT, "
                        "PSPARSE_TOKEN and PSPARSE_CONFIG set (torchrun's convention; on this "
                        "host MASTER_ADDR/MASTER_PORT too, for a process group); without "
                        "it the built-in loop trains --model on --dataset")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments passed on to TRAIN.PY")
    return p


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (default: server and workers on this host)")
    g.add_argument("--hostfile", type=Path, default=None,
                   help="lines 'host slots=K': workers fill the slots in order, started with "
                        "--rsh; the server runs here")
    g.add_argument("--slurm", action="store_true",
                   help="inside a SLURM allocation: the server here, workers through one srun "
                        "(--workers defaults to SLURM_NTASKS)")
    g.add_argument("--server-host", default=None,
                   help="address the workers use to reach this host's server (default: this "
                        "host's name)")
    g.add_argument("--port", type=int, default=5555,
                   help="server port in cluster modes (shard I of --servers S: this + I)")
    g.add_argument("--server-hosts", default=None, metavar="HOST,HOST,...|workers",
                   help="with --servers S in cluster modes: start shard I on the I-th host "
                        "through --rsh (S names, in shard order; each writes RUN_DIR/shard-I/ "
                        "on its host) instead of all shards here. 'workers': one shard beside "
                        "the workers on each worker host (S = their number; --servers may be "
                        "left out), so that every host's link carries about k + union entries "
                        "each way whatever the number of workers")
    g.add_argument("--bind", default="0.0.0.0",
                   help="server bind address in cluster modes (default 0.0.0.0)")
    g.add_argument("--rsh", default="ssh -o BatchMode=yes",
                   help="remote shell for --hostfile (default 'ssh -o BatchMode=yes')")
    g.add_argument("--python", default=None, metavar="PATH",
                   help="the interpreter that runs psparse (or TRAIN.PY) on the --hostfile, "
                        "--server-hosts and --slurm hosts (default: this launcher's, "
                        f"{sys.executable})")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --hostfile: CUDA_VISIBLE_DEVICES = local rank mod this, unless "
                        "already set")


def check_policy(cfg: RunConfig) -> None:
    """Build the policy as rank 0 will: on the real model's layout and k (no data loaded).
    A script's or a factory's model is not known here: then a 100,000-entry stand-in checks the
    policy's name and parameters."""
    policy_class(cfg.policy)  # an unknown name is told before torch is imported (~2 s)
    import torch

    from ..data import IN_SHAPES, NUM_CLASSES
    from ..ops.select.sparsify import density_to_k
    from ..training.models import build_model, check_factory

    if not cfg.script and ":" in cfg.model:
        check_factory(cfg.model, cfg.model_kwargs())  # takes the --model-arg keywords?
    if cfg.script or ":" in cfg.model or ":" in cfg.dataset:
        layout = Layout([100_000], cfg.granularity)
    else:
        with torch.device("meta"):  # sizes only: no memory, no initialisation
            model = build_model(cfg.model, IN_SHAPES[cfg.dataset], NUM_CLASSES[cfg.dataset],
                                cfg.model_kwargs())
        layout = Layout([p.numel() for p in model.parameters() if p.requires_grad],
                        cfg.granularity)
    build_policy(cfg.policy, cfg.policy_args, layout, density_to_k(cfg.density, layout.numel),
                 world_size=cfg.workers, seed=cfg.seed)


# ------------------------------------------------------------------------------ the run itself
def prepare_run_dir(plan: Plan) -> None:
    """logs/, the files a previous run here left that would mislead (a resumed run keeps its
    records), and config.json with the run's provenance (a resumed run keeps its own)."""
    (plan.out / "logs").mkdir(parents=True, exist_ok=True)
    stale = (PORT_FILE, SUMMARY_FILE) if plan.resume else \
        (PORT_FILE, SUMMARY_FILE, METRICS_FILE, EVAL_FILE)
    for name in stale:
        (plan.out / name).unlink(missing_ok=True)
        for index in range(plan.shards if plan.shards > 1 else 0):
            (keyranges.shard_dir(plan.out, index) / name).unlink(missing_ok=True)
    # rank 0's time split (--tensorboard): kept up to the resume point, before the progress
    # reader tails it (rank 0 only appends)
    if plan.cfg.tensorboard:
        open_truncated(plan.out / TIMING_FILE, lambda n, row: plan.resume and
                       row["iter"] < plan.start).close()
    if plan.resume:
        return
    record = {**json.loads(plan.cfg.to_json()), "provenance": provenance()}
    if plan.baseline:
        record["baseline"] = plan.baseline
        if plan.baseline == "powersgd":
            record["powersgd_rank"] = plan.powersgd_rank
            record["powersgd_warmup"] = plan.powersgd_warmup
    write_atomic(plan.config_path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def check_start(plan: Plan) -> None:
    """StartFailure, naming the problem, when the run cannot start: a port the servers started
    here would listen on is taken, or (on this host) the data set is missing."""
    t, cfg = plan.topology, plan.cfg
    if t.mode != "local" and not t.server_hosts and not plan.baseline:
        for index in range(plan.shards):
            why = port_taken(t.bind, t.port + index)
            if why:
                raise StartFailure(f"the run could not start: {plan.server_name(index)} "
                                   f"cannot listen on {t.bind}:{t.port + index}: {why} "
                                   "(another run or program has that port; choose another "
                                   "--port)")
    if t.mode == "local" and not plan.script:
        from .. import data  # (torch: imported where a run starts, not for --help or a bad flag)
        try:
            data.check_available(cfg.dataset, cfg.data_dir)
        except data.DataError as exc:
            raise StartFailure(f"the run could not start: {exc}") from None


def warm_up() -> None:
    """Before forking local children: import the worker (and torch, and torch.optim's lazy
    torch._dynamo) once, and start numba, compiling the CPU kernels if the cache lacks them
    (psparse/ops/jit.py, ``prepare``), so that no child pays for them: ~6 CPU-seconds each, ~25 s
    of start-up for 8 workers on 2 cores."""
    importlib.import_module("psparse.training.loop")
    importlib.import_module("torch._dynamo")
    jit.prepare()


def run(plan: Plan, quiet: bool = False, grace_s: float = 5.0, max_restarts: int = 0,
        backoff_s: float = BACKOFF_S) -> int:
    """Start the plan and watch it: 0 when every process ended well, else the first failure's
    code (the others stopped); 130 on Ctrl-C or SIGTERM. With ``max_restarts`` a failed run
    starts again from its newest complete checkpoint, up to that many times (restart.py)."""
    if plan.topology.mode == "local":  # in cluster modes nothing is forked that needs torch
        warm_up()
    restarts = Restarts(plan, max_restarts, backoff_s, say=lambda m: print(m, flush=True))
    return restarts.run(lambda plan: start_once(plan, quiet, grace_s))


def start_once(plan: Plan, quiet: bool, grace_s: float) -> tuple[int, Supervisor]:
    """One attempt: the run directory prepared, the servers and workers started and watched."""
    cfg = plan.cfg
    prepare_run_dir(plan)
    what = f"script {shlex.join(plan.script)}" if plan.script else f"{cfg.model}/{cfg.dataset}"
    workers = f"{cfg.workers} workers" if plan.ranks is None else \
        f"{len(plan.ranks)} of {cfg.workers} workers (ranks {plan.ranks}: those live at the " \
        f"checkpoint of iteration {plan.start})"
    print(f"psparse: {workers}, {what}, density {cfg.density:g}, run dir {plan.out}",
          flush=True)
    supervisor = Supervisor(plan.out, quiet=quiet, grace_s=grace_s,
                            elastic_from=plan.start if cfg.elastic else None)
    board = RunBoard(cfg.tensorboard, plan.out, plan.start, plan.attempt) \
        if cfg.tensorboard else None
    progress = Progress(plan.out, plan.shards, plan.baseline, quiet, board)

    def merge_shards():  # (each shard merges when it finishes; this covers a failed run)
        if plan.shards > 1 and not plan.baseline:
            merge_run_dir(plan.out, plan.shards)

    try:
        check_start(plan)
        for spec in plan.servers():
            supervisor.start(spec)
        ports = supervisor.wait_for_ports(plan.port_files(), cfg.timeout)
        for spec in plan.workers(plan.address(ports)):
            supervisor.start(spec)
        return supervisor.monitor(progress, on_end=merge_shards), supervisor
    except KeyboardInterrupt:
        print("\ninterrupted: stopping all processes", flush=True)
        supervisor.stop_all()
        return 130, supervisor
    except RuntimeError as exc:
        supervisor.error, supervisor.start_failed = str(exc), isinstance(exc, StartFailure)
        if not supervisor.start_failed:  # (a start failure is told on stderr: restart.py)
            print(f"psparse-launch: error: {exc}", flush=True)
        supervisor.stop_all()
        supervisor.stopped_at = time.time()
        return 1, supervisor
    finally:
        if board is not None:
            board.close()


# --------------------------------------------------------------------------------- the flags
def _resolve(p: argparse.ArgumentParser, args) -> RunConfig:
    """The run's options from the flags (or the resumed run's config.json), checked."""
    if args.resume is not None:
        if not (args.resume / "config.json").is_file():
            p.error(f"--resume {args.resume}: no config.json there (not a psparse run)")
        args.config, args.out = args.resume / "config.json", args.resume
    if args.script is not None:  # (--resume takes the script from config.json)
        if not Path(args.script).is_file():
            p.error(f"training script {args.script} not found")
        if args.baseline:
            p.error("--baseline trains the built-in loop; it does not take a script")
    try:
        cfg = resolve_config(args)
    except ConfigError as exc:
        p.error(str(exc))
    if args.script is not None:
        cfg.script = shlex.join([args.script, *args.script_args])
    try:  # fail here, before any process starts, on an unknown policy, parameter or factory
        for spec, what in ((cfg.model, "model factory"), (cfg.dataset, "dataset factory")):
            if plugin.is_spec(spec) and not cfg.script:
                plugin.load(spec, what)
        check_policy(cfg)
        if not cfg.script and cfg.memory == "adam" and cfg.optimizer != "adamw":
            raise ValueError("--memory adam takes each worker's Adam step: give --optimizer "
                             "adamw, so that the run (and its --baseline runs) say AdamW")
    except (PolicyError, ValueError) as exc:
        p.error(str(exc))
    if cfg.threads is None:
        cfg.threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    return cfg


def _topology(p: argparse.ArgumentParser, args, cfg: RunConfig) -> Topology:
    """Where the processes go, from the cluster flags (checked: enough slots, one host per
    shard)."""
    if not (args.hostfile or args.slurm):
        for flag, value in (("--server-hosts", args.server_hosts), ("--python", args.python)):
            if value is not None:
                p.error(f"{flag} applies to processes started on other hosts: use it with "
                        "--hostfile or --slurm")
        return Topology()
    if args.hostfile and args.slurm:
        p.error("--hostfile and --slurm exclude each other")
    server_hosts = None
    try:
        if args.slurm:
            hosts = [cluster.Host(h, 1) for h in cluster.slurm_nodes()]
            if args.workers is None:
                cfg.workers = cluster.slurm_workers()
            # (srun places W tasks on at most W nodes, the first ones)
            worker_hosts = [h.name for h in hosts][:max(1, cfg.workers)]
        else:
            hosts = cluster.parse_hostfile(args.hostfile.read_text(), str(args.hostfile))
            placed = cluster.place(hosts, cfg.workers)  # enough slots?
            worker_hosts = list(dict.fromkeys(host for _, host, _ in placed))
        if args.server_hosts is not None and args.server_hosts.strip() == "workers":
            server_hosts = _beside_workers(cfg, worker_hosts)
        elif args.server_hosts is not None:
            server_hosts = [h.strip() for h in args.server_hosts.split(",")]
            if len(server_hosts) != cfg.servers or not all(server_hosts):
                raise ValueError(f"--server-hosts names {len(server_hosts)} host(s) for "
                                 f"{cfg.servers} server shard(s) (--servers): give one host "
                                 "per shard, comma-separated, in shard order, or 'workers'")
    except (OSError, ValueError, ConfigError) as exc:
        p.error(str(exc))
    return Topology(mode="slurm" if args.slurm else "hostfile", hosts=hosts,
                    server_host=args.server_host or socket.gethostname(), port=args.port,
                    bind=args.bind, rsh=shlex.split(args.rsh), gpus_per_node=args.gpus_per_node,
                    server_hosts=server_hosts, python=args.python or sys.executable)


def _beside_workers(cfg: RunConfig, worker_hosts: list[str]) -> list[str]:
    """``--server-hosts workers``: shard I on the I-th host that runs workers, and as many
    shards as there are such hosts (``--servers`` set to that, or refused if it says another
    number). The run's options are checked again with their shards (--elastic, --shard-edges)."""
    if cfg.servers not in (1, len(worker_hosts)):
        raise ValueError(f"--server-hosts workers places one shard on each of the "
                         f"{len(worker_hosts)} worker hosts, but --servers is {cfg.servers}: "
                         f"leave --servers out or give {len(worker_hosts)}")
    cfg.servers = len(worker_hosts)
    cfg.validate()
    return worker_hosts


def _check_restarts(p: argparse.ArgumentParser, args, cfg: RunConfig) -> None:
    """--max-restarts needs checkpoints to restart from: it sets --checkpoint-every when the
    run has none (a resumed run keeps its own)."""
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.restart_backoff < 0:
        p.error("--restart-backoff must be >= 0 seconds")
    if args.max_restarts and args.baseline:
        p.error("--max-restarts restarts psparse runs from their checkpoints; the --baseline "
                "runs (torch DDP) keep none")
    if args.max_restarts and cfg.checkpoint_every == 0:
        cfg.checkpoint_every = DEFAULT_CHECKPOINT_EVERY


def _check_baseline(p: argparse.ArgumentParser, args, cfg: RunConfig) -> None:
    if args.baseline and (args.slurm or args.resume):
        p.error("--baseline runs on this host or with --hostfile, without --resume")
    if args.baseline and (cfg.servers > 1 or cfg.overlap or cfg.bucket_mb is not None):
        p.error("--baseline trains with torch DDP: " + ("--servers does not apply (no parameter "
                "server)" if cfg.servers > 1 else "--overlap and --bucket-mb do not apply"))
    if args.baseline == "powersgd" and cfg.local_steps > 1:
        p.error("--local-steps with --baseline is DiLoCo over allreduce (ddp, or bf16/fp16 "
                "pseudo-gradients); PowerSGD compresses gradients: use one of those")
    if args.powersgd_rank < 1:
        p.error("--powersgd-rank must be at least 1")
    if args.powersgd_warmup < 2:
        p.error("--powersgd-warmup must be at least 2 (PowerSGD's error feedback and warm "
                "start need one dense iteration first)")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    cfg = _resolve(p, args)
    topology = _topology(p, args, cfg)
    _check_baseline(p, args, cfg)
    _check_restarts(p, args, cfg)
    # The run's admission secret: only processes that hold it can register (docs/protocol.md).
    # Forked workers inherit it; --hostfile forwards PSPARSE_* variables, srun the environment.
    token = args.run_token or os.environ.get("PSPARSE_TOKEN") or secrets.token_hex(32)
    os.environ["PSPARSE_TOKEN"] = token
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401 (torch's SummaryWriter needs it)
        except ImportError:
            p.error("--tensorboard needs the tensorboard package: pip install "
                    "'psparse[tensorboard]' (or pip install tensorboard)")
    if cfg.data_dir:  # a script's loaders (psparse.data.load_dataset's default) read it too
        os.environ["PSPARSE_DATA"] = str(Path(cfg.data_dir).resolve())
    name = Path(args.script).stem if args.script else f"{cfg.model}-{cfg.dataset}"
    out = args.out or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    plan = Plan(cfg, out, out / "config.json", topology, token,
                script=shlex.split(cfg.script) if cfg.script else None, baseline=args.baseline,
                powersgd_rank=args.powersgd_rank, powersgd_warmup=args.powersgd_warmup,
                master_addr=args.master_addr,
                resume=args.resume is not None,
                rendezvous_port=free_port() if (args.baseline or args.script)
                and not (args.hostfile or args.slurm) else 0)

    if plan.resume and args.overwrite:
        p.error("--overwrite starts a fresh run and --resume continues one: give one of them")
    if plan.resume:
        done = complete_run(out)
        if done:
            print(f"psparse-launch: {out} is complete ({done}): nothing to resume, nothing "
                  "changed", file=sys.stderr, flush=True)
            return 0
    else:
        held = held_run(out)
        if held and not args.overwrite:
            p.error(f"--out {out} holds another run ({held}); a fresh run there would mix "
                    f"with it: choose a new --out, continue that run with --resume {out}, or "
                    "pass --overwrite to delete it first")
        if held:
            clear_run_dir(out)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    return run(plan, quiet=args.quiet, max_restarts=args.max_restarts,
               backoff_s=args.restart_backoff)


if __name__ == "__main__":
    sys.exit(main())
