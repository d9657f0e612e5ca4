"""``python -m dynamix_hvd``: the same as the ``dynamix-hvd`` command (see `dynamix_hvd.cli`)."""
from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
