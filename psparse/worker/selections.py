"""``--record-selections``: the index sets and accumulator measures a worker records for analysis.

``--record-selections``: what a worker records, per iteration, for ``psparse-locality``: the top-k
indices of its raw gradient, the indices it sent, and two measures of its accumulator (``captured``,
``backlog``; their definitions and the analysis are ``psparse/analysis/locality.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class SelectionRecorder:
    """Collects per-iteration index sets in memory; ``save`` writes one npz."""

    def __init__(self, layer_sizes: list[int], layer_names: list[str]):
        self.layer_sizes, self.layer_names = layer_sizes, layer_names
        self.grad_topk: list[np.ndarray] = []
        self.sent: list[np.ndarray] = []
        self.topk_energy: list[float] = []
        self.captured: list[float] = []
        self.backlog: list[float] = []

    def record(self, grad: np.ndarray, grad_topk: np.ndarray, sent: np.ndarray,
               accumulator: np.ndarray | None = None) -> None:
        """One iteration: the raw gradient, its top-k indices, the indices sent, and the
        accumulator the push was chosen from (None: not recorded)."""
        self.grad_topk.append(np.asarray(grad_topk, dtype=np.int64).copy())
        self.sent.append(np.asarray(sent, dtype=np.int64).copy())
        # "few entries are large": the share of the squared gradient norm in the top-k entries
        total = float(np.dot(grad, grad))
        top = grad[grad_topk]
        self.topk_energy.append(float(np.dot(top, top)) / total if total > 0 else 0.0)
        if accumulator is not None:
            energy = accumulator.astype(np.float64) ** 2
            k = len(grad_topk)
            due = float(np.partition(energy, energy.size - k)[-k:].sum()) if k else 0.0
            self.captured.append(float(energy[sent].sum()) / due if due > 0 else 1.0)
            self.backlog.append(float(np.sqrt(energy.sum() / total)) if total > 0 else 0.0)

    def save(self, path: Path) -> None:
        def packed(sets):
            offsets = np.cumsum([0] + [len(s) for s in sets])
            return np.concatenate(sets) if sets else np.empty(0, np.int64), offsets

        g, g_off = packed(self.grad_topk)
        s, s_off = packed(self.sent)
        np.savez_compressed(path, grad_topk=g, grad_offsets=g_off, sent=s, sent_offsets=s_off,
                            topk_energy=np.array(self.topk_energy),
                            captured=np.array(self.captured), backlog=np.array(self.backlog),
                            layer_sizes=np.array(self.layer_sizes),
                            layer_names=np.array(self.layer_names))
