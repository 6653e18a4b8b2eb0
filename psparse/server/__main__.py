"""``python -m psparse.server``: the parameter server's command line (psparse/server/cli.py)."""

import sys

from .cli import main

sys.exit(main())
