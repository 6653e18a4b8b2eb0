"""A worker's shard of the training set, its seeded minibatches, and the test set in batches.

What a training loop draws from a data set: one worker's shard and its seeded minibatches
(CIFAR's augmentation included), and the test set in batches."""

from __future__ import annotations

import numpy as np
import torch

from .dataset import Dataset


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
