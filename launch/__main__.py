"""``python -m launch`` is ``elastic-run``."""

from __future__ import annotations

import sys

from launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
