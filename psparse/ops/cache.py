"""Where numba keeps the compiled kernels: NUMBA_CACHE_DIR, the package's cache, or the user's.

Where numba keeps the compiled kernels (docs/architecture.md, "Compiled CPU kernels"):
``NUMBA_CACHE_DIR`` when it is set; else numba's own choice, ``__pycache__`` beside each kernel
source when psparse/ops/ is writable (an editable install: every process of a run or a test session
shares it; ``PACKAGE_CACHE`` holds the warm-up's stamp and locks); else, for a read-only install,
``$XDG_CACHE_HOME/psparse/numba``, and where even that cannot be written,
``<tmp>/psparse-numba-<uid>``. Imports no numba: both the loader (``jit.py``) and numba's
configuration (``numba_jit.py``) read it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PACKAGE_CACHE = Path(__file__).resolve().parent / "__pycache__"


def writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def cache_dir_fallback() -> Path | None:
    """Where the kernels are cached when neither NUMBA_CACHE_DIR is set nor the package's
    __pycache__ is writable (a read-only install); None when numba's own choice applies."""
    if os.environ.get("NUMBA_CACHE_DIR") or writable(PACKAGE_CACHE):
        return None
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for candidate in (home / "psparse" / "numba",
                      Path(tempfile.gettempdir()) / f"psparse-numba-{os.getuid()}"):
        if writable(candidate):
            return candidate
    return None  # nothing writable: numba compiles in every process, caching nothing
