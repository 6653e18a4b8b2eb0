"""Data loaders on the real data sets, and shards that partition them."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from psparse import config, data
from psparse.data import DataError, Shard, fetch_mnist, load_dataset, read_idx
from psparse.training import models


def test_mnist_loads_with_the_official_shapes(data_root):
    ds = load_dataset("mnist", data_root)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.train_x.dtype == np.uint8
    assert ds.test_x.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.train_y).tolist()[:3] == [5923, 6742, 5958]  # known class counts
    assert ds.train_y[:5].tolist() == [5, 0, 4, 1, 9]
    from psparse.data import IN_SHAPES

    assert IN_SHAPES["mnist"] == ds.in_shape  # what the launcher's policy check assumes


def test_fetch_mnist_copies_and_verifies_md5(data_root, tmp_path, capsys):
    dest = fetch_mnist(tmp_path / "mnist", data_root / "mnist")
    for name, md5 in data.MNIST_FILES.items():
        assert hashlib.md5((dest / name).read_bytes()).hexdigest() == md5
    fetch_mnist(dest)  # second time: nothing to do
    assert "already" in capsys.readouterr().out


def test_fetch_mnist_rejects_a_damaged_copy(data_root, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in data.MNIST_FILES:
        (src / name).write_bytes((data_root / "mnist" / name).read_bytes())
    (src / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not the real file")
    with pytest.raises(DataError, match="md5"):
        fetch_mnist(tmp_path / "dest", src)


def test_read_idx_raw_and_gz_and_garbage(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = b"\x00\x00\x08\x03" + np.array([2, 3, 4], ">u4").tobytes() + arr.tobytes()
    (tmp_path / "a").write_bytes(raw)
    (tmp_path / "b.gz").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_idx(tmp_path / "a"), arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "b.gz"), arr)
    (tmp_path / "c").write_bytes(raw[:-1])
    with pytest.raises(DataError, match="header says"):
        read_idx(tmp_path / "c")


def test_missing_mnist_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match="make data"):
        load_dataset("mnist", tmp_path)


def _write_image_archive(path: Path, per_class: int) -> dict:
    """A CIFAR-style image-folder tar.gz (train|test/<class>/NNNN.png); returns the pixels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    pixels = {}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for split in ("train", "test"):
            for cls in ("cat", "ship"):
                for i in range(per_class):
                    img = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                    b = io.BytesIO()
                    Image.fromarray(img).save(b, format="PNG")  # lossless: pixels comparable
                    info = tarfile.TarInfo(f"cifar10-jpeg/{split}/{cls}/{i:04d}.png")
                    info.size = b.tell()
                    b.seek(0)
                    tar.addfile(info, b)
                    pixels[(split, cls, i)] = img
    path.write_bytes(buf.getvalue())
    return pixels


def test_cifar_image_folder_archive_is_decoded_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PSPARSE_CACHE", str(tmp_path / "cache"))
    pixels = _write_image_archive(tmp_path / "cifar10-jpeg.tar.gz", per_class=2)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.train_x.shape == (4, 3, 32, 32) and ds.test_x.shape == (4, 3, 32, 32)
    assert ds.train_y.tolist() == [3, 3, 8, 8]  # cat = 3, ship = 8 in CIFAR order
    np.testing.assert_array_equal(ds.train_x[2], pixels[("train", "ship", 0)].transpose(2, 0, 1))
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    again = load_dataset("cifar10", tmp_path)  # from the cache
    np.testing.assert_array_equal(again.test_x, ds.test_x)


def test_the_same_archive_elsewhere_reuses_its_cache_and_another_does_not(tmp_path, monkeypatch,
                                                                          capsys):
    """The cache is named by the archive's bytes: a copy at another path with a new mtime (a
    fresh checkout, a new shared mount) reuses it; an archive with other images gets its own."""
    monkeypatch.setenv("PSPARSE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    _write_image_archive(tmp_path / "a" / "cifar10-jpeg.tar.gz", per_class=2)
    first = load_dataset("cifar10", tmp_path / "a")
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "cifar10-jpeg.tar.gz", tmp_path / "b" / "cifar10-jpeg.tar.gz")
    os.utime(tmp_path / "b" / "cifar10-jpeg.tar.gz", ns=(1, 1))
    capsys.readouterr()
    copy = load_dataset("cifar10", tmp_path / "b")
    assert "decoding CIFAR-10" not in capsys.readouterr().out
    np.testing.assert_array_equal(copy.train_x, first.train_x)
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    (tmp_path / "c").mkdir()
    _write_image_archive(tmp_path / "c" / "cifar10-jpeg.tar.gz", per_class=3)
    assert load_dataset("cifar10", tmp_path / "c").train_x.shape[0] == 6
    assert "decoding CIFAR-10" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_workers_starting_together_decode_the_archive_once(tmp_path):
    """Eight workers of a run load CIFAR at the same moment: one decodes, the rest wait for its
    cache (each decoding on its own once raced on the cache file and crashed a run)."""
    _write_image_archive(tmp_path / "cifar10-jpeg.tar.gz", per_class=300)
    env = {**os.environ, "PSPARSE_CACHE": str(tmp_path / "cache")}
    code = ("import sys, hashlib; from psparse.data import load_dataset; "
            "d = load_dataset('cifar10', sys.argv[1]); "
            "print('digest', hashlib.sha1(d.train_x.tobytes()).hexdigest())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in outs]
    stdout = "".join(out for out, _ in outs)
    assert stdout.count("decoding CIFAR-10") == 1, stdout
    assert len({line for line in stdout.splitlines() if line.startswith("digest")}) == 1
    assert [p.name for p in (tmp_path / "cache").glob("*.npz")] and \
        not list((tmp_path / "cache").glob("*.tmp.npz"))


def test_cifar_python_batches(tmp_path):
    import pickle

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 255, (3, 3072), dtype=np.uint8),
                 b"labels": [1, 2, 3]}
        (d / name).write_bytes(pickle.dumps(batch))
    ds = load_dataset("cifar10", tmp_path)
    assert ds.train_x.shape == (15, 3, 32, 32) and ds.test_y.tolist() == [1, 2, 3]


def test_shards_partition_the_training_set():
    ds = load_dataset("digits")
    shards = [Shard(ds, r, 4, 16, seed=3) for r in range(4)]
    all_idx = np.concatenate([s.indices for s in shards])
    assert len(np.unique(all_idx)) == len(all_idx) == 4 * (1500 // 4)
    x0, y0 = shards[1].batch(5)
    x1, y1 = Shard(ds, 1, 4, 16, seed=3).batch(5)  # same seed: same batch
    assert x0.shape == (16, 1, 8, 8) and np.array_equal(x0, x1) and np.array_equal(y0, y1)
    x2, _ = shards[1].batch(5 + shards[1].batches_per_epoch)  # next epoch: reshuffled
    assert not np.array_equal(x0, x2)


def test_config_name_lists_match_the_implementations():
    assert sorted(config.MODELS) == sorted(models.MODELS)
    assert sorted(config.DATASETS) == sorted(data.DATASETS)


def test_model_sizes():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(models.LeNet5()) == 61706
    assert 260_000 < count(models.ResNet20()) < 280_000


def test_a_corrupt_cache_is_decoded_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PSPARSE_CACHE", str(tmp_path / "cache"))
    _write_image_archive(tmp_path / "cifar10-jpeg.tar.gz", per_class=2)
    ds = load_dataset("cifar10", tmp_path)
    (cache,) = (tmp_path / "cache").glob("*.npz")
    cache.write_bytes(cache.read_bytes()[:100])  # e.g. a crash mid-write by an older version
    again = load_dataset("cifar10", tmp_path)
    np.testing.assert_array_equal(again.train_x, ds.train_x)


def test_in_shapes_match_the_data():
    """The launcher sizes the model from IN_SHAPES without loading data."""
    from psparse.data import DATASETS, IN_SHAPES, load_digits

    assert IN_SHAPES["digits"] == load_digits().in_shape
    assert set(IN_SHAPES) == set(DATASETS)


def test_eval_samples_is_a_fixed_subset_across_classes():
    """--eval-samples: the same random subset every time, not the first images (test sets may
    be stored grouped by class), and the whole set when samples is not given."""
    ds = data.load_digits()
    # make the stored order class-grouped, as CIFAR-10's JPEG archive is
    order = np.argsort(ds.test_y, kind="stable")
    ds.test_x, ds.test_y = ds.test_x[order], ds.test_y[order]
    labels = lambda n: np.concatenate([y.numpy() for _, y in data.test_batches(ds, 50, n)])  # noqa: E731
    part = labels(60)
    assert len(part) == 60 and np.array_equal(part, labels(60))
    assert len(np.unique(part)) >= 8  # the first 60 would be one or two classes
    assert len(labels(None)) == len(ds.test_y) == len(labels(10 ** 9))
