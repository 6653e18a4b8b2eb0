"""psparse: gradient-sparsification parameter server for PyTorch over ZeroMQ.

In your own training loop (README.md and docs/api.md)::

    import psparse
    ps = psparse.connect(model, optimizer, iterations=...)   # server, rank, world from env
    ...  loss.backward(); ps.exchange(loss); optimizer.step()  ...
    ps.close()

The folders are the layers, bottom to top (each imports only its own and lower ones;
psparse/layers.py, docs/architecture.md): cpu/ (numba kernels and their numpy references),
gpu/ (CUDA C, the radix engine, backends), wire/ (transport, codecs, messages), config and
options, server/, policies/, worker/ (the PS client, a round, the session), training/ and
data/, launch/, analysis/; this module and ddp_hook.py are what a user's script imports.
"""

from .provenance import __version__

__all__ = ["connect", "Session", "WorkerError", "ServerGone", "__version__"]


def __getattr__(name):
    # torch and pyzmq are imported only when the API is used, so the command-line tools that
    # never train (psparse-report, psparse-keys, ...) start quickly.
    if name == "connect":  # (the module is connection.py: a module "connect" would shadow it)
        from .worker.connection import connect
        return connect
    if name in ("Session", "WorkerError", "ServerGone"):
        from .worker import session
        return getattr(session, name)
    raise AttributeError(f"module 'psparse' has no attribute {name!r}")
