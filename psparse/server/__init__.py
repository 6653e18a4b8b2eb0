"""The parameter server (``psparse-server``, ``python -m psparse.server``), in rooms of one job:

* ``server.py``: a run's phases (registration, the rounds, the end) and checkpoints;
* ``endpoint.py``: the socket, bounded waits and heartbeats, decoding and authentication,
  refusals, sends and broadcasts with each connection's key cache, the link's pacing;
* ``rounds.py``: one round engine for whole-model rounds and rounds in parts;
* ``records.py``: metrics.jsonl, eval.jsonl, summary.json, and the shards' merge;
* ``cli.py``: the command line;
* ``membership.py``: who is in the run (admission, the agreed run, liveness; sends nothing);
* ``aggregation.py``: the round arithmetic on plain arrays (the sparse mean in rank order,
  vote, budgets, dense switch, size limit), compiled in ``psparse/ops/aggregate/agg_kernels.py``.

``Server``, ``build_parser`` and ``main`` are imported on first use, so reading records
(``psparse.server.records``, the report and the launcher's progress) needs no socket library.
"""

__all__ = ["Server", "build_parser", "main"]


def __getattr__(name):
    if name == "Server":
        from .server import Server
        return Server
    if name in ("build_parser", "main"):
        from . import cli
        return getattr(cli, name)
    raise AttributeError(f"module 'psparse.server' has no attribute {name!r}")
