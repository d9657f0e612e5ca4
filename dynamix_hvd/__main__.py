"""``python -m dynamix_hvd``: the same as the ``dynamix-hvd`` command (see `dynamix_hvd.tools.cli`)."""
from __future__ import annotations

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
