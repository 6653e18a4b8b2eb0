"""A stand-in that makes ``import tensorboard`` fail, for the test of psparse-launch's check
(tests/test_tensorboard.py puts this folder first on PYTHONPATH)."""

raise ImportError("No module named 'tensorboard' (tests/no_tensorboard)")
