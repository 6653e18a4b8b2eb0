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
