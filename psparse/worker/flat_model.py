"""The model's flat buffers: parameters and gradients as views of one vector each, on their device.

Where a worker's arrays live: the model's flat buffers and the device.

``FlatModel`` makes a model's parameters and gradients views of two flat float32 buffers (what
``psparse.worker.session`` exchanges; on the GPU path ``psparse.worker.device_round`` works on them
in place); ``pick_device`` chooses the device (the backend that runs on it:
``psparse.backends.cuda``).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from .client import WorkerError


class FlatModel:
    """A model whose parameters and gradients are views into two flat float32 buffers.

    Backward writes gradients straight into ``grad`` and the optimizer updates ``params`` in
    place, so a round reads and writes whole-model vectors with no gather/scatter copies. A loop
    that sets gradients to None (``optimizer.zero_grad()``'s default) gets fresh tensors from
    backward; ``gather_grad`` copies those in, and ``set_grad`` points ``.grad`` back here.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None):
        device = device or torch.device("cpu")
        self.model = model.to(device)
        self.device = device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.layer_names = [n for n, _ in named]
        params = [p for _, p in named]
        self.layer_sizes = [p.numel() for p in params]
        self.layer_shapes = [tuple(p.shape) for p in params]
        self.numel = sum(self.layer_sizes)
        self.params = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # Without CuPy a GPU gradient crosses to the host once per iteration, into pinned memory
        # (allocated on first use); with CuPy it stays on the device (psparse.worker.device_round).
        self.host_grad = self.grad if device.type == "cpu" else None
        self.grad_views = []
        offset = 0
        for p, n in zip(params, self.layer_sizes):
            # reshape: a channels_last parameter is not viewable as 1-D; as a view of the flat
            # buffer it becomes contiguous (the values are the same)
            self.params[offset:offset + n].copy_(p.data.reshape(-1))
            p.data = self.params[offset:offset + n].view_as(p)
            view = self.grad[offset:offset + n].view_as(p)
            p.grad = view
            self.grad_views.append(view)
            offset += n
        self.parameters = params
        self.mark_grads()

    def mark_grads(self) -> None:
        """Remember the gradients as they are now (the aggregate just applied), so that
        ``grads_changed`` can tell whether a backward pass has run since."""
        self._grad_versions = [view._version for view in self.grad_views]

    def grads_changed(self) -> bool:
        """Whether a gradient changed since ``mark_grads``: backward adds into ``.grad`` in
        place (its version counter moves) or, after ``zero_grad()``, sets a new tensor. False:
        no backward ran, every ``.grad`` is None or still the aggregate."""
        return any(p.grad is not None and (p.grad is not view or view._version != version)
                   for p, view, version in zip(self.parameters, self.grad_views,
                                               self._grad_versions))

    def checksum(self) -> str:
        return hashlib.blake2b(self.params.cpu().numpy().data, digest_size=8).hexdigest()

    def gather_grad(self) -> None:
        """Bring gradients that are not our views into the flat buffer (None counts as 0)."""
        self.gather_layers(0, len(self.parameters))

    def grad_array(self) -> np.ndarray:
        """The gradient as a numpy array: the CPU tensor's own memory, or a pinned host copy of
        a CUDA gradient (a GPU worker without CuPy selects on the host)."""
        if self.host_grad is None:
            self.host_grad = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
        if self.host_grad is not self.grad:
            self.host_grad.copy_(self.grad)
        return self.host_grad.numpy()

    def gather_layers(self, first: int, end: int) -> None:
        """``gather_grad`` for the parameters of layers [first, end) only (one bucket)."""
        for p, view in zip(self.parameters[first:end], self.grad_views[first:end]):
            if p.grad is view:
                continue
            if p.grad is None:
                view.zero_()
            elif p.grad.is_sparse:  # nn.Embedding(sparse=True): duplicates summed
                view.copy_(p.grad.to_dense())
            else:
                view.copy_(p.grad)
            p.grad = view

    def grad_range(self, lo: int, hi: int) -> np.ndarray:
        """``grad_array``'s entries [lo, hi) (one bucket), copying only those to the host."""
        if self.host_grad is None:
            self.host_grad = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
        if self.host_grad is not self.grad:
            self.host_grad[lo:hi].copy_(self.grad[lo:hi])
        return self.host_grad.numpy()[lo:hi]

    def set_grad(self, indices: np.ndarray | None, values: np.ndarray) -> None:
        """The aggregate into .grad: dense values, or values at indices (zeros elsewhere)."""
        for p, view in zip(self.parameters, self.grad_views):
            p.grad = view  # a loop may have replaced or dropped them since gather_grad
        if self.device.type == "cpu":
            grad = self.grad.numpy()
            if indices is None:
                grad[:] = values
            else:
                grad[:] = 0.0
                grad[indices] = values
            return
        vals = torch.from_numpy(np.asarray(values)).to(self.device)
        if indices is None:
            self.grad.copy_(vals)
        else:
            self.grad.zero_()
            self.grad[torch.from_numpy(np.asarray(indices, dtype=np.int64)).to(self.device)] = vals


def local_rank(rank: int) -> int:
    """This process's index on its node: torchrun's LOCAL_RANK, SLURM_LOCALID, else the rank."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return rank


def pick_device(name: str, rank: int) -> torch.device:
    """cpu, or one GPU per worker: local rank modulo the visible devices (CUDA_VISIBLE_DEVICES
    is respected by CUDA itself); "auto" is cuda when a GPU is visible."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WorkerError("--device cuda, but no CUDA device is visible")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


