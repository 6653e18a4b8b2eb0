"""Selection policies: which k entries each worker pushes. One file per policy.

``--policy NAME`` picks one from ``REGISTRY``; ``--policy package.module:ClassName`` loads a
user class (a subclass of ``SelectionPolicy``); ``--policy-arg key=value`` sets its parameters.
"""

from __future__ import annotations

import numpy as np

from .. import plugin
from .base import Layout, Param, PolicyError, SelectionPolicy, check_output
from .cltk import CyclicLocalTopK
from .core import SharedCore
from .ema import EMA
from .exdyna import ExDyna
from .frequency import Frequency
from .micro import Micro
from .penalty import Penalty
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK
from .vote import Vote

REGISTRY: dict[str, type[SelectionPolicy]] = {
    cls.name: cls
    for cls in (TopK, RandomK, Threshold, Frequency, EMA, Penalty, CyclicLocalTopK, SharedCore,
                Vote, Micro, ExDyna)
}

__all__ = ["REGISTRY", "Layout", "Param", "PolicyError", "SelectionPolicy", "build_policy",
           "check_output", "parse_policy_args", "policy_class"]


def policy_class(spec: str) -> type[SelectionPolicy]:
    """A registered name, or ``package.module:ClassName`` for a user class."""
    if ":" not in spec:
        if spec not in REGISTRY:
            raise PolicyError(f"unknown policy {spec!r}; registered: {', '.join(REGISTRY)} "
                              "(or give package.module:ClassName)")
        return REGISTRY[spec]
    def is_policy(value) -> bool:
        return isinstance(value, type) and issubclass(value, SelectionPolicy)

    try:  # the plug-in rule of every user object (psparse/plugin.py)
        return plugin.load(spec, "policy", accepts=is_policy,
                           kind=("a SelectionPolicy subclass", "SelectionPolicy classes"))
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def parse_policy_args(items: list[str] | dict | None) -> dict[str, str]:
    """``["beta=0.9", "lam=16"]`` (or a dict from a config file) -> {"beta": "0.9", ...}."""
    if not items:
        return {}
    if isinstance(items, dict):
        return {str(k): v for k, v in items.items()}
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"--policy-arg {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def build_policy(spec: str, args, layout: Layout, k: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, xp=np, dev=None) -> SelectionPolicy:
    """The policy named by ``spec`` with its ``--policy-arg`` values; arrays on ``xp``, or on
    the device backend ``dev`` (a GPU worker: psparse.backends.cuda)."""
    cls = policy_class(spec)
    return cls(layout, k, rank=rank, world_size=world_size, seed=seed, xp=xp, dev=dev,
               **parse_policy_args(args))
