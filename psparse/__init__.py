"""psparse: gradient-sparsification parameter server for PyTorch over ZeroMQ.

Layers, bottom to top (each imports only those below it):
transport (sockets) -> protocol (codec, validation) -> server (aggregation, accounting)
sparsify (selection), models, data -> worker (training loop) -> launch (processes).
"""

__version__ = "0.1.0"
