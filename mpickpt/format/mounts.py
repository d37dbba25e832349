"""Which mount a path is on, from ``/proc/self/mountinfo``: its file system type and options, for
what the options change about mpickpt's guarantees (locks kept per host: the writer lock then
refuses a second job on this host only)."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(r"\\([0-7]{3})")  # a space in a mount point is written \040


class Mount(NamedTuple):
    point: str
    fstype: str
    options: tuple[str, ...]  # the mount's and its file system's, together


def parse(line: str) -> Mount | None:
    """One line of ``mountinfo`` (``ID PARENT MAJ:MIN ROOT POINT OPTS [TAGS...] - TYPE SOURCE
    SUPER_OPTS``); None for a line not of that shape."""
    fields = line.split()
    if "-" not in fields[6:]:
        return None
    dash = fields.index("-", 6)
    if len(fields) < dash + 3:
        return None
    point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
    extra = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
    return Mount(point, fields[dash + 1], (*fields[5].split(","), *extra))


def mount_of(path: str, table: str | None = None) -> Mount | None:
    """The mount ``path`` lies on (the last mounted of the longest matching mount point), by
    ``table`` (default :data:`MOUNTINFO`); None where the table cannot be read."""
    real = os.path.realpath(path)
    try:
        with open(table or MOUNTINFO, encoding="utf-8", errors="replace") as f:
            mounts = [m for m in map(parse, f) if m is not None]
    except OSError:
        return None
    best: Mount | None = None
    for m in mounts:
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def per_host_locks(path: str, table: str | None = None) -> str | None:
    """How ``path``'s mount keeps ``flock`` locks per host, not across the cluster (NFS mounted
    ``local_lock=flock`` or ``all``, Lustre ``localflock``), as the option names it; None where
    it does not, or cannot be told."""
    m = mount_of(path, table)
    if m is None:
        return None
    for opt in m.options:
        if (m.fstype.startswith("nfs") and opt in ("local_lock=flock", "local_lock=all")) or \
                (m.fstype == "lustre" and opt == "localflock"):
            return f"{m.fstype} mounted {opt} at {m.point}"
    return None
