"""The library's one logging path: `logging` loggers under ``dynamix_hvd``, rank-prefixed output.

Library code logs through ``get_logger(__name__)`` and never prints. Warnings a user needs (a stop
request wrote a checkpoint and the job is exiting; a rank was found slower and given fewer samples)
are shown by default: importing puts a WARNING-level handler on the package logger that writes to
stderr as ``[dynamix_hvd rank 1] warning: message``, and stays silent while the application has
configured the root logger (the records reach the application's handlers there, once).
`configure_logging()`, which the examples and the CLI call, replaces it and shows records from
`level` on; an application that wants none of them sets the package logger's level
(``logging.getLogger("dynamix_hvd").setLevel(logging.ERROR)``). The rank comes from the launcher's
environment (``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``, ``HOROVOD_RANK``, ``SLURM_PROCID``), so the
prefix is right before ``hvd.init()`` and under every launcher. No MPI, no Horovod.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

PACKAGE = "dynamix_hvd"
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROVOD_RANK", "SLURM_PROCID")



def launcher_rank() -> int | None:
    """This process's rank as the launcher set it in the environment (None when not launched)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def get_logger(name: str) -> logging.Logger:
    """The logger for module `name` (``__name__``), always under the ``dynamix_hvd`` logger."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        name = f"{PACKAGE}.{name}"
    return logging.getLogger(name)


class RankFormatter(logging.Formatter):
    """``[dynamix_hvd rank R] message``; warnings and errors also name their level."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        rank = launcher_rank() if rank is None else rank
        self.prefix = f"[{PACKAGE}]" if rank is None else f"[{PACKAGE} rank {rank}]"

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        level = f" {record.levelname.lower()}:" if record.levelno >= logging.WARNING else ""
        return f"{self.prefix}{level} {text}"


class _ConfiguredHandler(logging.StreamHandler):
    """Marks the handler `configure_logging` installed, so a second call replaces it."""


class DefaultHandler(logging.Handler):
    """The package's handler until the application chooses one: WARNING and above to the current
    ``sys.stderr``, rank-prefixed, unless the root logger has handlers of the application's (then
    the record reaches them by propagation, and showing it here too would print it twice)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(RankFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging must never raise into the training loop
            self.handleError(record)


DEFAULT_HANDLER = DefaultHandler()
"""The handler importing the package installs (see the module docstring)."""
logging.getLogger(PACKAGE).addHandler(DEFAULT_HANDLER)


def configure_logging(level: int | str = logging.INFO, stream: TextIO | None = None) -> logging.Handler:
    """Show the package's records at `level` and above on `stream` (stderr), rank-prefixed.

    For applications (the examples and the CLI call it); calling it again replaces the handler it
    installed before. Records still propagate to the root logger, so an application that configures
    the root itself should not call this as well.
    """
    logger = logging.getLogger(PACKAGE)
    for old in [h for h in logger.handlers if isinstance(h, (_ConfiguredHandler, DefaultHandler))]:
        logger.removeHandler(old)
    handler = _ConfiguredHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(RankFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
