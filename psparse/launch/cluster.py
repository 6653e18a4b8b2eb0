"""Command lines for other hosts: hostfiles and ssh, SLURM's srun, the forwarded environment.

Starting workers on other hosts: hostfiles and ssh, SLURM (what a worker reads from torchrun's,
SLURM's or MPI's environment is ``psparse/worker/environment.py``).

Pure helpers (parsing, rank placement, command lines) used by ``psparse-launch --hostfile`` and
``--slurm``; every worker gets its whole configuration on its command line, so no shared
filesystem is needed for it (the data set must exist on each host, under --data-dir).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields

from ..config import SERVER_CONFIG, RunConfig

# Forwarded to remote workers when set here (the rest of the environment stays on this host).
# The float-kernel caps too (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, MKL_CBWR, ...): a run
# capped for reproducibility must be capped on every host (docs/api.md, "Determinism").
FORWARD_ENV = re.compile(r"^(PSPARSE_|PYTHONPATH$|OMP_NUM_THREADS$|CUDA_VISIBLE_DEVICES$|"
                         r"NCCL_|MKL_NUM_THREADS$|ONEDNN_|DNNL_|ATEN_CPU_CAPABILITY$|MKL_CBWR$|"
                         r"MKL_ENABLE_INSTRUCTIONS$)")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Lines ``host [slots=K]``; ``#`` starts a comment; blank lines are skipped."""
    hosts = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = 1
        for extra in parts[1:]:
            m = re.fullmatch(r"slots=(\d+)", extra)
            if not m or int(m.group(1)) < 1:
                raise ValueError(f"{source}:{n}: expected 'host slots=K' (K >= 1), got {raw!r}")
            slots = int(m.group(1))
        if not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]+", parts[0]):
            raise ValueError(f"{source}:{n}: {parts[0]!r} is not a host name")
        hosts.append(Host(parts[0], slots))
    if not hosts:
        raise ValueError(f"{source}: no hosts")
    return hosts


def place(hosts: list[Host], workers: int) -> list[tuple[int, str, int]]:
    """(rank, host, local rank) for each worker, filling hosts' slots in order."""
    total = sum(h.slots for h in hosts)
    if workers > total:
        raise ValueError(f"{workers} workers but the hostfile has only {total} slots")
    out, rank = [], 0
    for h in hosts:
        for local in range(h.slots):
            if rank == workers:
                return out
            out.append((rank, h.name, local))
            rank += 1
    return out


def config_flags(cfg: RunConfig, only: tuple[str, ...] | None = None) -> list[str]:
    """The configuration as command-line flags (what a remote worker needs to know; ``only``:
    just these options, e.g. a server's)."""
    args = []
    for f in fields(RunConfig):
        if only is not None and f.name not in only:
            continue
        value = getattr(cfg, f.name)
        if value is None or value is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("policy_args", "model_args"):  # repeatable: --policy-arg, --model-arg
            for item in value:
                args += [flag[:-1], item]
        elif value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


def worker_argv(cfg: RunConfig, server: str, out: str, rank: int | None = None,
                python: str = sys.executable) -> list[str]:
    argv = [python, "-m", "psparse.training.loop", *config_flags(cfg), "--connect", server,
            "--out", out]
    return argv + (["--rank", str(rank)] if rank is not None else [])


def server_argv(cfg: RunConfig, bind: str, port: int, out: str, shard: tuple[int, int],
                python: str = sys.executable) -> list[str]:
    """A server shard's command line on another host (its options as flags: no shared
    filesystem is assumed for config.json)."""
    return [python, "-m", "psparse.server", *config_flags(cfg, SERVER_CONFIG), "--bind", bind,
            "--port", str(port), "--out", out, "--shard", f"{shard[0]}/{shard[1]}"]


def remote_command(rsh: list[str], host: str, argv: list[str], cwd: str,
                   env: dict[str, str]) -> list[str]:
    """``rsh host 'cd CWD && env K=V ... ARGV'``: one shell line for the remote login shell."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    line = f"cd {shlex.quote(cwd)} && exec env {assignments} {shlex.join(argv)}"
    return [*rsh, host, line]


def forwarded_env(environ=os.environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if FORWARD_ENV.match(k)}


def slurm_nodes(environ=os.environ) -> list[str]:
    """The allocation's host names, in order (``scontrol show hostnames``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("--slurm: SLURM_JOB_NODELIST is not set (run inside an allocation: "
                         "sbatch or salloc)")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ValueError(f"--slurm: cannot expand {nodelist!r} with scontrol: {exc}") from None
    return out.split()


def slurm_workers(environ=os.environ) -> int:
    for var in ("SLURM_NTASKS", "SLURM_NPROCS"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    raise ValueError("--slurm: SLURM_NTASKS is not set (give --ntasks to sbatch/salloc)")


def srun_prefix(cfg: RunConfig) -> list[str]:
    """srun starting one task per worker; if one fails, srun kills the others."""
    return ["srun", "--ntasks", str(cfg.workers), "--kill-on-bad-exit=1", "--label"]


def srun_command(cfg: RunConfig, server: str, out: str,
                 python: str = sys.executable) -> list[str]:
    """One srun for all workers; each takes its rank from SLURM_PROCID."""
    return [*srun_prefix(cfg), *worker_argv(cfg, server, out, python=python)]
