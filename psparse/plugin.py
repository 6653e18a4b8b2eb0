"""Loading the user's own objects from ``package.module:name``: models, data sets, policies.

One rule for every plug-in point: the module is imported (from the working directory or
PYTHONPATH), ``name`` must exist there and be the right kind of object; every failure is a
``ValueError`` that names the spec and lists what the module does define of that kind.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def is_spec(text: str) -> bool:
    """Whether ``text`` names a user object (``module:name``) rather than a built-in."""
    return ":" in text


def load(spec: str, what: str, accepts: Callable[[object], bool] = callable,
         kind: tuple[str, str] = ("a callable", "callables")) -> object:
    """Object ``name`` of ``module`` in ``spec`` = "module:name". ``what`` ("model factory",
    "policy") goes into the error messages; ``accepts`` says whether an object is of the right
    kind (default: callable), ``kind`` names that kind (one, many) in them."""
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
    if obj is None or not accepts(obj):
        found = sorted(n for n, v in vars(module).items()
                       if not n.startswith("_") and accepts(v)
                       and getattr(v, "__module__", None) == module.__name__)
        problem = f"no {attr!r} in module {module_name!r}" if obj is None else \
            f"{attr!r} in module {module_name!r} is not {kind[0]}"
        raise ValueError(f"{what} {spec!r}: {problem}; {kind[1]} defined there: "
                         f"{', '.join(found) or '(none)'}")
    return obj
