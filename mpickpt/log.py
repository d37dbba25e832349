"""The 'mpickpt' logger: one line per event, prefixed with the rank."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("mpickpt")


def setup(rank: int) -> logging.Logger:
    """Give the logger a stderr handler with a rank prefix, unless the application configured one.

    MPICKPT_LOG=DEBUG|INFO|WARNING|ERROR sets the level (INFO by default).
    """
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[mpickpt rank {rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("MPICKPT_LOG", "INFO").upper())
    return logger
