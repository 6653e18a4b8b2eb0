"""scikit-learn's 8x8 digits: the small data set the fast tests train on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .dataset import DataError, Dataset


def load_digits() -> Dataset:
    """scikit-learn's 1,797 8x8 digits (shipped with the package), split 1,500 / 297.

    Read straight from the CSV inside the installed scikit-learn: importing sklearn itself costs
    ~1.5 s per worker process, which dominates short test runs.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set comes with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    images, y = table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    x = np.clip(np.round(images * (255.0 / 16.0)), 0, 255).astype(np.uint8)[:, None]
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    return Dataset("digits", x[:1500], y[:1500], x[1500:], y[1500:], mean=(0.3,), std=(0.38,))
