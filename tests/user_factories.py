"""A user's model and data set for the built-in loop (--model / --dataset package.module:factory)."""

import numpy as np
from sklearn.datasets import load_digits
from torch import nn

from psparse.data import Dataset


def small_cnn(in_shape, num_classes):
    channels, height, width = in_shape
    return nn.Sequential(nn.Conv2d(channels, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * height * width, num_classes))


def digits_float(data_dir):
    """scikit-learn's digits as float32 images in [0, 1] (the factory ignores data_dir)."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return Dataset("digits-float", x[:1500], y[:1500], x[1500:], y[1500:], mean=(0.3,),
                   std=(0.38,))


def not_a_dataset(data_dir):
    return [1, 2, 3]


def wide_mlp(in_shape, num_classes):
    """An MLP of 3.4 MB (860k parameters) that DDP splits into two gradient buckets by its
    defaults: the gradients come in reverse layer order, and the last two layers' (1.3 MB)
    already fill its 1 MiB first bucket, so the first layer's go to a second one."""
    features = int(np.prod(in_shape))
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 8192), nn.ReLU(),
                         nn.Linear(8192, 40), nn.ReLU(), nn.Linear(40, num_classes))
