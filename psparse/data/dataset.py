"""The ``Dataset`` a run trains on, the ``DataError`` a missing one raises, the built-in names.

The data set a run trains on (``Dataset``), the error a missing or damaged one raises, the
built-in names and their input shapes, and where data and caches live by default."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS = ("mnist", "cifar10", "digits", "text")
# Input shape of each data set ((C, H, W) for images, (characters,) for text) and its classes,
# known without loading it (the launcher sizes the model with them for its pre-start policy
# check); the tests compare them with the loaded data.
IN_SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "digits": (1, 8, 8), "text": (64,)}
NUM_CLASSES = {"mnist": 10, "cifar10": 10, "digits": 10, "text": 128}


@dataclass
class Dataset:
    name: str
    train_x: np.ndarray  # uint8 (N, C, H, W); text: uint8 character codes (N, T)
    train_y: np.ndarray  # int64 (N,); text: the next characters (N, T)
    test_x: np.ndarray
    test_y: np.ndarray
    mean: tuple[float, ...]  # per channel, in [0, 1] pixel units
    std: tuple[float, ...]
    num_classes: int = 10
    augment: bool = False  # random crop (pad 4) + horizontal flip, for CIFAR
    kind: str = "images"  # or "text": samples are token ids, labelled at every position

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        if self.kind == "text":  # token ids: an embedding's indices
            return x_uint8.long()
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        x = x_uint8.float() / 255.0 if x_uint8.dtype == torch.uint8 else x_uint8
        return (x - mean) / std


class DataError(RuntimeError):
    """A data set is missing or damaged; the text says where it was looked for and what to do."""


def default_data_dir() -> Path:
    return Path(os.environ.get("PSPARSE_DATA", "data"))


def cache_dir() -> Path:
    return Path(os.environ.get("PSPARSE_CACHE", Path.home() / ".cache" / "psparse"))
