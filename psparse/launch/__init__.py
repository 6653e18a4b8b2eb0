"""The launcher (``psparse-launch``, ``python -m psparse.launch``), in rooms of one job:

* ``plan.py``: what a run starts, as data (process specs per topology: local, ``--hostfile``,
  ``--slurm``, ``--baseline``), decided before anything starts;
* ``processes.py``: forked children (torch already imported) and piped client processes (ssh,
  srun), each dying with the launcher;
* ``supervisor.py``: starting the specs, waiting for the servers to listen, the first failure
  and a clean stop;
* ``progress.py``: the progress line and the summary table;
* ``restart.py``: ``--max-restarts``, the whole run again from its newest checkpoint;
* ``cli.py``: the flags, the checks before anything starts, the run directory, the run.

``build_parser``, ``main`` and ``run`` are imported on first use (``psparse.launch.main``).
"""

__all__ = ["build_parser", "main", "run"]


def __getattr__(name):
    if name in __all__:
        from . import cli
        return getattr(cli, name)
    raise AttributeError(f"module 'psparse.launch' has no attribute {name!r}")
