"""CIFAR-10 from the official python batches or a tree or archive of JPEGs, decoded once and cached.

CIFAR-10 from the official python batches or an image-folder tree or archive of JPEGs, the
decoded JPEGs cached once per archive (keyed by its bytes)."""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from .dataset import DataError, Dataset, cache_dir

CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                 "truck")


def load_cifar10(data_dir: Path) -> Dataset:
    """CIFAR-10 from the official python batches or an image-folder tree/archive of JPEGs.

    Looked for, in order: ``cifar-10-batches-py/``, ``cifar10-jpeg/`` (``train|test/<class>/*``),
    ``cifar10-jpeg.tar.gz``, each under ``data_dir``. Decoded JPEGs are cached as .npy.
    """
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    source = find_cifar10(data_dir)
    if source.name == "cifar-10-batches-py":
        train = [_unpickle(source / f"data_batch_{i}") for i in range(1, 6)]
        test = _unpickle(source / "test_batch")
        tx = np.concatenate([b[b"data"] for b in train]).reshape(-1, 3, 32, 32)
        ty = np.concatenate([b[b"labels"] for b in train]).astype(np.int64)
        vx = np.asarray(test[b"data"]).reshape(-1, 3, 32, 32)
        vy = np.asarray(test[b"labels"], dtype=np.int64)
        return Dataset("cifar10", tx, ty, vx, vy, mean, std, augment=True)
    return Dataset("cifar10", *_cifar_jpeg_cached(source), mean, std, augment=True)


def find_cifar10(data_dir: Path) -> Path:
    """The first of cifar-10-batches-py/, cifar10-jpeg/, cifar10-jpeg.tar.gz under data_dir."""
    if (data_dir / "cifar-10-batches-py").is_dir():
        return data_dir / "cifar-10-batches-py"
    for source in (data_dir / "cifar10-jpeg", data_dir / "cifar10-jpeg.tar.gz"):
        if source.exists():
            return source
    raise DataError(f"CIFAR-10 not found under {data_dir}: expected cifar-10-batches-py/ (the "
                    "official python version), cifar10-jpeg/ or cifar10-jpeg.tar.gz "
                    "(train|test/<class>/*.jpg); set --data-dir or PSPARSE_DATA")


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="bytes")


def _cache_key(source: Path) -> str:
    """An archive is keyed by its bytes (hashing the 19 MB archive takes ~30 ms): the same
    archive reached by another path, or copied afresh with a new mtime (a CI checkout, a new
    shared mount), reuses one 185 MB cache instead of adding another. A folder tree, too many
    files to hash cheaply, is keyed by its path and mtime."""
    if source.is_file():
        digest = hashlib.sha1()
        with open(source, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
        return digest.hexdigest()[:12]
    stat = source.stat()
    return hashlib.sha1(f"{source.resolve()}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def _cifar_jpeg_cached(source: Path):
    path = cache_dir() / f"cifar10-{_cache_key(source)}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    # All workers of a run start together: one decodes (~20 s of CPU) while the others wait on
    # the lock and then read its cache, instead of all decoding and racing on the same file.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            try:
                with np.load(path) as z:
                    return z["tx"], z["ty"], z["vx"], z["vy"]
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
                print(f"cache {path} unreadable ({e}); decoding again", flush=True)
                path.unlink()
        _decode_cifar_jpegs(source, path)
        with np.load(path) as z:
            return z["tx"], z["ty"], z["vx"], z["vy"]


def _decode_cifar_jpegs(source: Path, path: Path) -> None:
    print(f"decoding CIFAR-10 JPEGs from {source} (once; cached in {path}) ...", flush=True)
    images: dict[str, list] = {"train": [], "test": []}
    for split, cls, data in _iter_jpegs(source):
        images[split].append((cls, data))
    arrays = {}
    for split, (xname, yname) in (("train", ("tx", "ty")), ("test", ("vx", "vy"))):
        items = sorted(images[split], key=lambda t: (t[0], t[1][0]))
        if not items:
            raise DataError(f"{source}: no {split}/<class>/*.jpg images found")
        arrays[xname] = np.stack([_decode_jpeg(data) for _, (_, data) in items])
        arrays[yname] = np.array([CIFAR_CLASSES.index(cls) for cls, _ in items], dtype=np.int64)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)  # atomic: a reader sees the whole file or none


def _iter_jpegs(source: Path):
    """Yield (split, class, (name, bytes)) for every image of a folder tree or tar archive."""
    def parse(rel: str):
        parts = rel.split("/")
        for i in range(len(parts) - 2):
            if parts[i] in ("train", "test") and parts[i + 1] in CIFAR_CLASSES:
                return parts[i], parts[i + 1]
        return None

    if source.is_dir():
        for p in source.rglob("*"):
            if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg", ".png"):
                where = parse(p.relative_to(source).as_posix())
                if where:
                    yield where[0], where[1], (p.name, p.read_bytes())
        return
    with tarfile.open(source) as tar:
        for m in tar:
            if m.isfile() and m.name.lower().endswith((".jpg", ".jpeg", ".png")):
                where = parse(m.name)
                if where:
                    yield where[0], where[1], (m.name.rsplit("/", 1)[-1],
                                               tar.extractfile(m).read())


def _decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    if arr.shape != (32, 32, 3):
        raise DataError(f"CIFAR image has shape {arr.shape}, expected 32x32 RGB")
    return arr.transpose(2, 0, 1)
