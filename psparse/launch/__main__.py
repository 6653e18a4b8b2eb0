"""``python -m psparse.launch``: the launcher's command line (psparse/launch/cli.py)."""

import sys

from .cli import main

sys.exit(main())
