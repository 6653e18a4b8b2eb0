"""psparse: gradient-sparsification parameter server for PyTorch over ZeroMQ.

In your own training loop (README.md and docs/api.md)::

    import psparse
    ps = psparse.connect(model, optimizer, iterations=...)   # server, rank, world from env
    ...  loss.backward(); ps.exchange(loss); optimizer.step()  ...
    ps.close()

Layers, bottom to top (each imports only those below it):
  transport (sockets, pacing, CurveZMQ) -> codec, protocol (messages, index encodings)
  -> rundir (run directory files); aggregation (round arithmetic on plain arrays, over
     kernels and sparsify); membership (admission, agreement, liveness; sends nothing) -> server
  kernels, sparsify (top-k), memory (error feedback), policies (selection), models, data,
  checkpoint -> client (the worker's protocol side) -> device (flat buffers, device choice)
  -> exchange (a round's shapes, its clock and context), device_round (the GPU's round),
     parts (a round in buckets) -> session (the user's object), connection (connect)
  -> worker (the built-in loop), ddp -> cluster, launch (processes, hosts)
Tools on top: report, costmodel, locality, keys, kernel_check.
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
