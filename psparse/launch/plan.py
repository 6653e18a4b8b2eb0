"""What a launch starts, decided before anything starts: one list of process specs per topology.

Pure: no process, no socket, no file written. A run is its server shards (``servers``), then its
workers (``workers``, once the servers' address is known: local shards listen on ports of their
own choosing). Topologies:

* local (the default): everything forked from the launcher on this host;
* ``--hostfile``: servers forked here (or, with ``--server-hosts``, shard I started on the I-th
  host through ``--rsh``), workers started through ``--rsh`` on the hosts' slots;
* ``--slurm``: servers here, the workers through one ``srun``;
* ``--baseline ddp|fp16|bf16|powersgd``: no server, DDP ranks (forked here, or through ``--rsh``).

A user's TRAIN.PY replaces the built-in worker loop in every topology, with torchrun's
environment (``script_env``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..rundir import PORT_FILE
from ..wire import keyranges
from . import cluster


class StartFailure(RuntimeError):
    """The run could not start (a port in use, a data set or a program missing, a server that
    exited before it listened, a plan the topology cannot start): starting it again would fail
    the same way, so --max-restarts does not (restart.py). The text names the problem."""


@dataclass
class Spec:
    """One process. ``fork``: module ``argv[0]``'s ``main(argv[1:])`` in a fork of the launcher;
    ``script``: the user's TRAIN.PY (``argv``) in a fork, with ``env`` added; ``command``: a
    local client (ssh, srun) running ``argv`` with ``env`` added, its output piped here, each
    line prefixed with ``prefix``."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    prefix: str = ""


@dataclass
class Topology:
    """Where the processes go: ``mode`` local, hostfile or slurm; for the cluster modes the
    hosts, the address the workers reach the server at, its port and bind address, the remote
    shell, GPUs per node, the shards' hosts (None: every shard here) and the interpreter that
    runs psparse (or the script) on the hosts."""

    mode: str = "local"
    hosts: list = field(default_factory=list)
    server_host: str = "127.0.0.1"
    port: int = 5555
    bind: str = "127.0.0.1"
    rsh: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None
    server_hosts: list[str] | None = None
    python: str = sys.executable


@dataclass
class Plan:
    cfg: RunConfig
    out: Path
    config_path: Path
    topology: Topology
    token: str
    script: list[str] | None = None  # [TRAIN.PY, ARGS...]: the user's loop
    baseline: str | None = None  # ddp, fp16, bf16 or powersgd: torch DDP instead of psparse
    powersgd_rank: int = 4
    powersgd_warmup: int = 1000  # dense iterations before PowerSGD compresses
    master_addr: str | None = None
    resume: bool = False
    rendezvous_port: int = 0  # a local baseline's or script's: where DDP ranks meet (free port)
    # the worker ranks to start: None for all; an elastic run resumed from a checkpoint after
    # it lost workers goes on with the ranks live then (checkpoint.resume_point)
    ranks: list[int] | None = None
    start: int = 0  # the iteration the run starts (resumes) at
    attempt: int = 0  # which attempt this is (--max-restarts: 0 the first, then 1, 2, ...)

    @property
    def shards(self) -> int:
        return self.cfg.servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.cfg.workers)) if self.ranks is None else list(self.ranks)

    def server_name(self, index: int) -> str:
        """The process (and log) name of server shard ``index``: "server" for a single one."""
        return "server" if self.shards == 1 else f"server-{index}"

    def server_dir(self, index: int) -> Path:
        return self.out if self.shards == 1 else keyranges.shard_dir(self.out, index)

    def _again(self) -> list[str]:
        return ["--resume"] if self.resume else []

    def _shard_flag(self, index: int) -> list[str]:
        return [] if self.shards == 1 else ["--shard", f"{index}/{self.shards}"]

    # ----------------------------------------------------------------------------- servers
    def servers(self) -> list[Spec]:
        """The server shards (none for a baseline)."""
        if self.baseline:
            return []
        t, out = self.topology, str(self.out.resolve())
        local = t.mode == "local"
        specs = []
        for index in range(self.shards):
            name = self.server_name(index)
            if t.server_hosts:  # shard I on the I-th host
                argv = cluster.server_argv(self.cfg, t.bind, t.port + index, out,
                                           (index, self.shards), t.python) + self._again()
                specs.append(Spec(name, "command", cluster.remote_command(
                    t.rsh, t.server_hosts[index], argv, os.getcwd(), cluster.forwarded_env()),
                    prefix=f"{name}| "))
                continue
            specs.append(Spec(name, "fork", [
                "psparse.server", "--config", str(self.config_path),
                *(["--port", "0"] if local else ["--bind", t.bind, "--port", str(t.port + index)]),
                "--out", str(self.out), *self._shard_flag(index), *self._again()]))
        return specs

    def port_files(self) -> list[tuple[str, Path]]:
        """(server name, its port file) of the shards that write one here (a remote shard's
        is on its host: the workers just connect)."""
        if self.baseline or self.topology.server_hosts:
            return []
        return [(self.server_name(i), self.server_dir(i) / PORT_FILE) for i in range(self.shards)]

    def address(self, ports: list[int]) -> str:
        """HOST:PORT of every shard, comma-separated in shard order (``ports``: the local
        shards' own, as they listen)."""
        t = self.topology
        if t.mode == "local":
            return ",".join(f"127.0.0.1:{port}" for port in ports)
        return ",".join(f"{t.server_hosts[i] if t.server_hosts else t.server_host}:"
                        f"{t.port + i}" for i in range(self.shards))

    # ----------------------------------------------------------------------------- workers
    def workers(self, server: str) -> list[Spec]:
        """The workers (or DDP ranks) of the run, given the servers' address."""
        if self.baseline:
            return self._baseline_ranks()
        cfg, t = self.cfg, self.topology
        if t.mode == "local":
            if self.script:
                config = {"PSPARSE_CONFIG": str(self.config_path.resolve()),
                          "PSPARSE_CONFIG_JSON": "",
                          # torchrun's rendezvous, for a script that also builds a torch
                          # process group (DDP with psparse's comm hook)
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.rendezvous_port)}
                return [Spec(f"rank-{r}", "script", self.script,
                             self.script_env(r, r, server, config)) for r in self.worker_ranks]
            return [Spec(f"rank-{r}", "fork", [
                "psparse.training.loop", "--config", str(self.config_path), "--rank", str(r),
                "--connect", server, "--out", str(self.out), *self._again()])
                for r in self.worker_ranks]
        out = str(self.out.resolve())
        # a script's workers get the configuration inline: no shared filesystem is assumed
        inline = {"PSPARSE_CONFIG_JSON": json.dumps(json.loads(self.config_path.read_text()),
                                                    separators=(",", ":")),
                  "PSPARSE_CONFIG": ""}  # a path inherited from this shell would win
        if t.mode == "slurm":
            if self.ranks is not None:
                raise StartFailure(f"the run could not start: this elastic run resumes with "
                                   f"ranks {self.ranks} only, and one srun starts them all: "
                                   "resume it with --hostfile")
            if self.script:  # srun passes the environment on; each task's rank: SLURM_PROCID
                env = {k: v for k, v in self.script_env(0, 0, server, inline).items()
                       if k not in ("RANK", "LOCAL_RANK")}
                # torchrun's names from SLURM's, per task, before the script starts
                argv = cluster.srun_prefix(cfg) + [
                    "sh", "-c", 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec "$@"',
                    "psparse-task", t.python, *self.script]
                return [Spec("workers", "command", argv, env, prefix="rank ")]
            return [Spec("workers", "command", cluster.srun_command(cfg, server, out, t.python)
                         + self._again(), prefix="rank ")]
        specs = []
        for rank, host, local in cluster.place(t.hosts, cfg.workers):
            if rank not in self.worker_ranks:  # (a lost rank's slot stays empty)
                continue
            env = {**cluster.forwarded_env(), "LOCAL_RANK": str(local)}
            if t.gpus_per_node and "CUDA_VISIBLE_DEVICES" not in env:
                env["CUDA_VISIBLE_DEVICES"] = str(local % t.gpus_per_node)
            if self.script:
                env.update(self.script_env(rank, local, server, inline))
                argv = [t.python, *self.script]
            else:
                argv = cluster.worker_argv(cfg, server, out, rank, t.python) + self._again()
            specs.append(Spec(f"rank-{rank}", "command", cluster.remote_command(
                t.rsh, host, argv, os.getcwd(), env), prefix=f"rank {rank}| "))
        return specs

    def _baseline_flags(self) -> list[str]:
        return ["--baseline", self.baseline, "--powersgd-rank", str(self.powersgd_rank),
                "--powersgd-warmup", str(self.powersgd_warmup)]

    def _baseline_ranks(self) -> list[Spec]:
        """DDP ranks: forked here around a local rendezvous, or through --rsh on the hostfile's
        hosts with rank 0's host as the rendezvous (torch's TCPStore) at --master-addr (default:
        its host's name), port --port."""
        cfg, t = self.cfg, self.topology
        if t.mode == "local":
            return [Spec(f"rank-{r}", "fork", [
                "psparse.training.ddp", "--config", str(self.config_path), "--rank", str(r),
                "--port", str(self.rendezvous_port), "--out", str(self.out),
                *self._baseline_flags()])
                for r in range(cfg.workers)]
        if t.mode != "hostfile":
            raise RuntimeError("--baseline with --slurm is not supported; use --hostfile")
        placed = cluster.place(t.hosts, cfg.workers)
        master = self.master_addr or placed[0][1]
        out = str(self.out.resolve())
        specs = []
        for rank, host, local in placed:
            env = {**cluster.forwarded_env(), "LOCAL_RANK": str(local)}
            argv = [t.python, "-m", "psparse.training.ddp", *cluster.config_flags(cfg), "--rank",
                    str(rank), "--port", str(t.port), "--master-addr", master, "--out", out,
                    *self._baseline_flags()]
            specs.append(Spec(f"rank-{rank}", "command", cluster.remote_command(
                t.rsh, host, argv, os.getcwd(), env), prefix=f"rank {rank}| "))
        return specs

    def script_env(self, rank: int, local: int, server: str, config: dict) -> dict[str, str]:
        """What a user script's psparse.connect() reads (torchrun's names where they exist)."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.cfg.workers), "LOCAL_RANK": str(local),
                "PSPARSE_SERVER": server, "PSPARSE_OUT": str(self.out.resolve()),
                "PSPARSE_TOKEN": self.token, "PSPARSE_RESUME": "1" if self.resume else "0",
                **config}
