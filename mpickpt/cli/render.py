"""Output for people and for scripts: tables, colour (on a terminal only), progress bars, JSON.

Colour is used only when the stream is a terminal, ``NO_COLOR`` is unset or empty and ``TERM`` is
not ``dumb``. Progress bars go to stderr and only when stderr is a terminal. With ``--json`` the
only thing on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from ..log import human_bytes

_CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}
STATUS_STYLE = {"committed": "green", "corrupt": "red", "unsupported": "red",
                "unreadable": "yellow", "misnamed": "yellow", "hdf5-damaged": "yellow",
                "partial": "yellow", "quarantined": "yellow"}


def use_colour(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


@dataclass
class Cell:
    """A table cell with a style: its width is that of ``text``, not of the escape codes."""

    text: str
    style: str = ""


class Out:
    """Where a command's report goes; ``quiet`` (ranks other than 0 under MPI) prints nothing."""

    def __init__(self, as_json: bool = False, stream: TextIO | None = None,
                 err: TextIO | None = None, quiet: bool = False) -> None:
        self.as_json = as_json
        self.stream = stream or sys.stdout
        self.err = err or sys.stderr
        self.quiet = quiet
        self.colour = use_colour(self.stream)

    def style(self, text: str, *styles: str) -> str:
        codes = [_CODES[s] for st in styles for s in st.split() if s]
        if not self.colour or not codes:
            return text
        return f"\033[{';'.join(codes)}m{text}\033[0m"

    def line(self, text: str = "") -> None:
        """A line of the human report (nothing with --json)."""
        if not self.quiet and not self.as_json:
            print(text, file=self.stream, flush=True)

    def problem(self, text: str) -> None:
        """An error or warning for a person, on stderr (nothing with --json: it is in the JSON)."""
        if not self.quiet and not self.as_json:
            colour = use_colour(self.err)
            print(f"\033[31m{text}\033[0m" if colour else text, file=self.err, flush=True)

    def json(self, obj: dict[str, Any]) -> None:
        if not self.quiet and self.as_json:
            print(json.dumps(obj, indent=1, allow_nan=False), file=self.stream, flush=True)

    def progress(self, label: str, total: int) -> Progress:
        """A progress bar on stderr (drawn only on a terminal, never by a quiet rank)."""
        return Progress(label, total, self.err, enabled=False if self.quiet else None)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[str | Cell]],
              right: Sequence[int] = (), indent: str = "") -> None:
        """Columns padded to their widest cell; the columns in ``right`` are right-aligned."""
        cells = [[c if isinstance(c, Cell) else Cell(c) for c in row] for row in rows]
        head = [Cell(h, "bold") for h in headers]
        widths = [max(len(r[i].text) for r in [head, *cells]) for i in range(len(headers))]
        for row in [head, *cells]:
            parts = []
            for i, c in enumerate(row):
                pad = widths[i] - len(c.text)
                text = self.style(c.text, c.style)
                parts.append(" " * pad + text if i in right else text + " " * pad)
            self.line((indent + "  ".join(parts)).rstrip())


def human_span(seconds: float) -> str:
    """``"45 s"``, ``"12 min"``, ``"2 h 5 min"``, ``"3 d 4 h"`` (whole seconds, rounded down)."""
    s = int(seconds)
    if s < 90:
        return f"{s} s"
    m = s // 60
    if m < 90:
        return f"{m} min"
    h, m = divmod(m, 60)
    return f"{h} h {m} min" if h < 48 else f"{h // 24} d {h % 24} h"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < -1:
        return "in the future (clock skew?)"
    return f"{human_span(max(seconds, 0))} ago"


def local_time(t: float | None) -> str:
    """A Unix time as local date and time; "-" for None or a time no clock shows (a damaged
    file's: NaN, 1e300)."""
    try:
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError, TypeError):
        return "-"


def iso_utc(t: float | None) -> str | None:
    try:
        return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError, TypeError):
        return None


class Progress:
    """A progress bar with bytes/s on stderr, drawn only on a terminal; ``add`` is thread-safe."""

    WIDTH = 28

    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = (enabled if enabled is not None
                        else bool(getattr(self.stream, "isatty", lambda: False)()))
        self.label, self.total, self.done = label, max(total, 0), 0
        self.t0 = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and now - self._drawn >= 0.1:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self.WIDTH)
        rate = self.done / max(now - self.t0, 1e-6)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:3.0f}%  "
                          f"{human_bytes(self.done)} of {human_bytes(self.total)}  "
                          f"{human_bytes(rate)}/s\033[K{end}")
        self.stream.flush()

    @property
    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.t0, 1e-6)

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                self._draw(time.monotonic(), end="\n")
