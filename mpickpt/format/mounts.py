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
    dev: str  # MAJ:MIN, as st_dev gives it
    fstype: str
    options: tuple[str, ...]  # the mount's and its file system's, together


def parse(line: str) -> Mount | None:
    """One line of ``mountinfo`` (``ID PARENT MAJ:MIN ROOT POINT OPTS [TAGS...] - TYPE SOURCE
    SUPER_OPTS``, fields apart by one space: a source may be empty); None for a line not of
    that shape."""
    fields = line.rstrip("\n").split(" ")
    if "-" not in fields[6:]:
        return None
    dash = fields.index("-", 6)
    if len(fields) < dash + 3:
        return None
    point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
    extra = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
    return Mount(point, fields[2], fields[dash + 1], (*fields[5].split(","), *extra))


def _under(path: str, point: str) -> bool:
    return path == point or path.startswith(point.rstrip("/") + "/")


def mount_of(path: str, table: str | None = None) -> Mount | None:
    """The mount ``path`` lies on, by ``table`` (default :data:`MOUNTINFO`): of the mounts
    whose point holds it, those of its device (a mount hidden by a later one over a shorter
    point is not), the last mounted of the longest point; None where the table cannot be
    read."""
    real = os.path.realpath(path)
    try:
        with open(table or MOUNTINFO, "rb") as f:  # names as the file system has them
            mounts = [m for m in (parse(os.fsdecode(b)) for b in f) if m is not None]
    except OSError:
        return None
    try:
        st = os.stat(real).st_dev
        dev = f"{os.major(st)}:{os.minor(st)}"
    except OSError:
        dev = None
    holding = [m for m in mounts if _under(real, m.point)]
    best: Mount | None = None
    for m in [m for m in holding if m.dev == dev] or holding:
        if best is None or len(m.point) >= len(best.point):
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
