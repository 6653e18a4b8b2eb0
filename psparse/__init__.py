"""psparse: gradient-sparsification parameter server for PyTorch over ZeroMQ.

Layers, bottom to top (each imports only those below it):
  transport (sockets, pacing, CurveZMQ) -> codec, protocol (messages, index encodings)
  -> server (aggregation, limits, liveness, accounting)
  sparsify (top-k), memory (error feedback), policies (selection) , models, data, checkpoint
  -> worker (training loop) -> cluster, launch (processes, hosts)
Tools on top: report, costmodel, locality, keys.
"""

__version__ = "0.1.0"
