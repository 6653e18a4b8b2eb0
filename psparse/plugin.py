"""Loading the user's own objects from ``package.module:name`` (models, data sets).

One rule for all plug-in points: the module is imported (from the working directory or
PYTHONPATH), ``name`` must exist there and be callable; every failure is a ``ValueError`` that
names the spec and what was found instead. Policies use the same convention
(``psparse.policies.policy_class``, which also checks the class).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def is_spec(text: str) -> bool:
    """Whether ``text`` names a user object (``module:name``) rather than a built-in."""
    return ":" in text


def load(spec: str, what: str) -> Callable:
    """The callable ``name`` of ``module`` in ``spec`` = "module:name"; ``what`` ("model
    factory", "dataset factory") goes into the error messages."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected package.module:name")
    if "" not in sys.path:  # python -m and console scripts: the working directory too
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import the {what}'s module {module_name!r}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        problem = "no" if obj is None else "not callable:"
        raise ValueError(f"{what} {spec!r}: {problem} {attr!r} in module {module_name!r}; "
                         f"callables defined there: {', '.join(found) or '(none)'}")
    return obj
