"""``text``: characters of the Python standard library's own source, for the built-in
character-level transformer (``--model gpt``). Every machine with Python has it; nothing is
downloaded.

The first ``CHARS`` characters of the standard library's top-level modules, sorted by name, as
byte codes (non-ASCII bytes as 0, so 128 symbols); the first 90% train, the last 10% test.
A sample is a window of ``BLOCK`` characters and its targets the same window shifted by one
(next-character prediction at every position): training windows start every ``STRIDE``
characters, test windows do not overlap. The text differs between Python versions, so results
name theirs (``--dataset text`` on Python 3.11 here).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from .dataset import DataError, Dataset

CHARS = 1_100_000
BLOCK = 64
STRIDE = 16
VOCAB = 128


def corpus(chars: int = CHARS) -> np.ndarray:
    """The first ``chars`` characters of the standard library's modules (sorted by name) as
    uint8 codes below 128."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= chars:
            break
    if len(text) < chars:
        raise DataError(f"the standard library's source holds {len(text)} characters, fewer "
                        f"than the {chars} the text data set needs (a Python without its "
                        f".py files?)")
    codes = np.frombuffer(bytes(text[:chars]), dtype=np.uint8).copy()
    codes[codes >= VOCAB] = 0
    return codes


def windows(codes: np.ndarray, stride: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(inputs uint8 (N, block), targets int64 (N, block)): windows starting every ``stride``
    characters, the targets one character on."""
    starts = np.arange(0, len(codes) - block - 1, stride)
    index = starts[:, None] + np.arange(block)[None, :]
    return codes[index], codes[index + 1].astype(np.int64)


def unigram_loss(train: np.ndarray, test: np.ndarray) -> float:
    """The test loss (nats per character) of predicting the training text's character
    frequencies (add-one smoothed): the baseline a language model must beat."""
    counts = np.bincount(train, minlength=VOCAB) + 1.0
    return float(-np.log(counts[test] / counts.sum()).mean())


def load_text() -> Dataset:
    codes = corpus()
    split = int(0.9 * len(codes))
    train_x, train_y = windows(codes[:split], STRIDE)
    test_x, test_y = windows(codes[split:], BLOCK)
    return Dataset("text", train_x, train_y, test_x, test_y, mean=(), std=(),
                   num_classes=VOCAB, kind="text")
