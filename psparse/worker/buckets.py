"""Buckets of layers: the parts a round is exchanged in (``--bucket-mb``, ``--overlap``).

Backward produces the last layers' gradients first, so, as DDP does, buckets are contiguous
groups of layers taken in *reverse* registration order, each about ``bucket_mb`` MB of float32
gradients: a bucket takes layers until the next one would push it over the size (a layer larger
than the size is a bucket of its own). Because the flat parameter vector holds the layers in
registration order, every bucket is a contiguous key range of it: a *part* of the round
(docs/protocol.md, Parts). Parts are numbered in key order, so the last part (the last layers)
is ready first in backward.

Pure helpers, no torch, no sockets: the session plans the buckets, the run description carries
their boundaries (``parts``), and the server and client split and merge by them.
"""

from __future__ import annotations

__all__ = ["plan", "boundaries"]


def plan(layer_sizes: list[int], bucket_mb: float) -> list[tuple[int, int]]:
    """Buckets as layer ranges [first, end) in key order (part 0 holds layer 0), formed from
    the last layer backwards, each about ``bucket_mb`` MB (4 bytes per entry)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
    cap = bucket_mb * 1e6 / 4  # entries
    buckets = []
    end, size = len(layer_sizes), 0
    for layer in range(len(layer_sizes) - 1, -1, -1):
        if size and size + layer_sizes[layer] > cap:
            buckets.append((layer + 1, end))
            end, size = layer + 1, 0
        size += layer_sizes[layer]
    if end > 0:
        buckets.append((0, end))
    return buckets[::-1]


def boundaries(layer_sizes: list[int], buckets: list[tuple[int, int]]) -> list[int]:
    """The parts' key boundaries: part p holds keys [b[p], b[p + 1]) of the flat vector."""
    offsets = [0]
    for n in layer_sizes:
        offsets.append(offsets[-1] + n)
    return [offsets[first] for first, _ in buckets] + [offsets[-1]]
