"""A worker's rank, world size and server address, read from torchrun's, SLURM's or MPI's variables.

What a worker reads from its environment: its rank and the world size (torchrun, SLURM, PMI or
Open MPI variables) and the server's address (``PSPARSE_SERVER``, or ``MASTER_ADDR`` with
``PSPARSE_PORT``), and the ``HOST:PORT[,HOST:PORT...]`` form of server shards."""

from __future__ import annotations

import os


def parse_servers(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT`` or, for key-range server shards, ``HOST:PORT,HOST:PORT,...`` in shard
    order -> [(host, port), ...] (brackets around an IPv6 host are dropped)."""
    out = []
    for item in str(text).split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"server must be HOST:PORT (several, comma-separated, for server "
                             f"shards), got {text!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def rank_from_env(environ=os.environ) -> int | None:
    """This process's rank from torchrun, SLURM, PMI or Open MPI variables."""
    for var in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return None


def world_size_from_env(environ=os.environ) -> int | None:
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return None


def server_from_env(environ=os.environ) -> str | None:
    """PSPARSE_SERVER=host:port, else MASTER_ADDR with PSPARSE_PORT (default 5555)."""
    if environ.get("PSPARSE_SERVER"):
        return environ["PSPARSE_SERVER"]
    if environ.get("MASTER_ADDR"):
        return f"{environ['MASTER_ADDR']}:{environ.get('PSPARSE_PORT', '5555')}"
    return None
