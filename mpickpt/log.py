"""The 'mpickpt' logger: one line per event, prefixed with the rank."""

from __future__ import annotations

import logging
import os
import sys

from . import knobs

logger = logging.getLogger("mpickpt")


def human_bytes(n: float | None) -> str:
    """``1234567`` -> ``"1.2 MB"``: B, kB, MB, GB or TB, whichever fits."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    """``2.5e9`` -> ``"2.5 GB/s"``, ``3.1e6`` -> ``"3.1 MB/s"``: a unit that fits."""
    return f"{human_bytes(bytes_per_s)}/s"


def os_error(e: BaseException, path: str | None = None) -> str:
    """What went wrong, without repeating ``path``: an OSError's reason (``Permission denied``),
    with the file it names when that is another one (a file inside ``path``, say)."""
    if not isinstance(e, OSError) or not e.strerror:
        return str(e)
    if e.filename is not None and os.fspath(e.filename) != path:
        return f"{e.strerror}: {os.fspath(e.filename)}"
    return e.strerror


def setup(rank: int) -> logging.Logger:
    """Give the logger a stderr handler with a rank prefix, unless the application configured one.

    MPICKPT_LOG=DEBUG|INFO|WARNING|ERROR sets the level (INFO by default).
    """
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[mpickpt rank {rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(knobs.LOG.get())
    return logger
