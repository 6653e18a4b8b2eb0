"""topk: the k entries of largest |accumulator| (the baseline every other policy is measured by).

Each worker picks its own largest entries, so with N workers the union grows toward N*k when
their gradients differ.
"""

from .base import SelectionPolicy


class TopK(SelectionPolicy):
    name = "topk"
