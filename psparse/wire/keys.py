"""psparse-keys: create CurveZMQ key pairs for a run (server, and one per worker rank).

    psparse-keys DIR --workers 8

writes DIR/server.key(_secret), DIR/worker-R.key(_secret) for R = 0..7, and DIR/authorized/
with the workers' public keys. Give the server DIR (it needs server.key_secret and authorized/)
and each worker DIR (it needs server.key and its own worker-R.key_secret) via --curve-keys.
Secret files are created mode 0600; copy each host only what it needs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .transport import create_keys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="psparse-keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="folder for the key files")
    p.add_argument("--workers", type=int, required=True, help="number of worker key pairs")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    made = create_keys(args.dir, args.workers)
    print(f"wrote {len(made)} key files to {args.dir} (authorized: "
          f"{len(list((args.dir / 'authorized').glob('*.key')))} workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
