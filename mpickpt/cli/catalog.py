"""What lies under ROOT, as the tools see it: one :class:`Entry` per directory that matters.

* ``step-XXXXXXXX/``: a committed checkpoint, what ``Checkpointer.restore()`` considers (the same
  listing, :func:`mpickpt.format.rootdir.committed` with directories whose manifest is missing).
  Its status is ``committed`` until a check fails, then ``corrupt``; ``unreadable`` when this
  user may not read it (not known to be damaged), ``misnamed`` when its manifest is another
  step's (moved or copied there: restore refuses it), ``unsupported`` for another format
  version, ``hdf5-damaged`` when only the HDF5 metadata is wrong (restore still loads it).
* ``step-XXXXXXXX.partial-<run>/`` (a save that never committed: its note says which ranks'
  shards are incomplete or missing, see :mod:`.diagnose`) and ``*.deleting-<run>`` or
  ``*.replaced-<run>`` (a removal that was interrupted): status ``partial``. Restore never loads
  them; the next ``Checkpointer`` removes those of other runs.
* ``quarantine/<name>``: moved aside by these tools (see :mod:`.changes`); status ``quarantined``.

Anything else (``stats.jsonl``, ``ROLLBACK.json``, files of the user) is left alone.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from ..format import rootdir
from ..format.manifest import FORMAT, VERSIONS, Manifest, read_bytes
from ..format.manifest import NAME as MANIFEST
from . import diagnose
from .render import iso_utc

QUARANTINE = "quarantine"
QUARANTINE_LOG = "QUARANTINE.jsonl"
ROLLBACK = "ROLLBACK.json"
_ANY_STEP_RE = re.compile(r"^step-(\d{8,})")
# what Checkpointer.restore() loads: intact, or with damaged HDF5 metadata (it never reads that)
LOADABLE = ("committed", "hdf5-damaged")
# the statuses of a committed checkpoint, once checked
CHECKED = ("committed", "corrupt", "unreadable", "misnamed", "unsupported", "hdf5-damaged")


@dataclass
class Problem:
    """Why a checkpoint fails verification: the sentence restore would log, and where."""

    reason: str
    rank: int | None = None
    file: str | None = None
    unsupported: bool = False  # a manifest of another mpickpt version: not damage
    restorable: bool = False  # HDF5 metadata only: the tensors verify, restore still loads it
    denied: bool = False  # this user may not read it: not known to be damaged
    misnamed: bool = False  # the manifest is another step's: intact, but not loadable there

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "rank": self.rank, "file": self.file}


@dataclass
class Entry:
    name: str
    path: str
    status: str  # committed | corrupt | unreadable | misnamed | unsupported | hdf5-damaged |
    #              partial | quarantined
    step: int | None
    time: float | None = None  # the manifest's creation time, else the newest mtime inside
    world_size: int | None = None
    bytes: int | None = None
    run_id: str | None = None
    verified: str | None = None  # quick | full: the checks a committed checkpoint passed
    problems: list[Problem] = field(default_factory=list)  # by rank: restore names the first
    note: str | None = None
    current: bool = False
    modified: float | None = None  # newest mtime of the directory and its files
    manifest: Manifest | None = field(default=None, repr=False)
    shards: dict[str, Any] | None = None  # a partial directory's shards (diagnose.PartialShards)

    @property
    def problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def fail(self, problems: list[Problem]) -> None:
        """Mark as corrupt where any problem is damage, else by what the problems are (see the
        module); the problems sorted by rank, the manifest's first."""
        self.problems = sorted(self.problems + problems,
                               key=lambda p: -1 if p.rank is None else p.rank)
        ps = self.problems
        damage = [p for p in ps
                  if not (p.unsupported or p.restorable or p.denied or p.misnamed)]
        self.status = ("unsupported" if any(p.unsupported for p in ps) else
                       "corrupt" if damage else
                       "unreadable" if any(p.denied for p in ps) else
                       "misnamed" if any(p.misnamed for p in ps) else "hdf5-damaged")
        self.verified = None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name, "path": self.path, "step": self.step, "status": self.status,
            "current": self.current, "verified": self.verified, "time": self.time,
            "time_iso": iso_utc(self.time),
            "age_s": None if self.time is None else round(now - self.time, 3),
            "world_size": self.world_size, "bytes": self.bytes, "run_id": self.run_id,
            "problems": [p.to_json() for p in self.problems], "note": self.note,
            "shards": self.shards,
        }


def _files(path: str) -> tuple[int, float | None]:
    """Total bytes of the plain files directly in ``path`` and the newest mtime (dir included)."""
    total, newest = 0, None
    try:
        newest = os.lstat(path).st_mtime
        with os.scandir(path) as it:
            for f in it:
                st = f.stat(follow_symlinks=False)
                newest = max(newest, st.st_mtime)
                if f.is_file(follow_symlinks=False):
                    total += st.st_size
    except OSError:
        pass
    return total, newest


def step_of(name: str) -> int | None:
    """The step in a directory name (``step-00000020``, ``step-00000020.partial-x``, ...)."""
    m = _ANY_STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _loose(name: str, path: str, status: str, note: str | None) -> Entry:
    size, modified = _files(path)
    return Entry(name, path, status, step_of(name), time=modified, bytes=size, note=note,
                 modified=modified)


def quarantine_reasons(root: str) -> dict[str, str]:
    """Name in ROOT/quarantine/ -> why it was put there (the last record of the log)."""
    out = {}
    try:
        fd = rootdir.open_regular(os.path.join(root, QUARANTINE, QUARANTINE_LOG))
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    out[str(rec["to_name"])] = str(rec["reason"])
                except (ValueError, KeyError, TypeError, RecursionError):
                    continue  # a line cut short by a crash
    except OSError:
        pass
    return out


def scan(root: str) -> list[Entry]:
    """Committed checkpoints newest first, then partial directories, then quarantined ones."""
    out = [Entry(os.path.basename(p), p, "committed", s)
           for s, p in rootdir.committed(root, require_manifest=False)]
    loose = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not rootdir.is_real_dir(path):
            continue
        if m := rootdir.PARTIAL_RE.match(name):
            shards = diagnose.partial_shards(path, m.group(2), [e.path for e in out])
            e = _loose(name, path, "partial", shards.note())
            e.shards = shards.to_json()
            if shards.basis is None:  # the run's own world size
                e.world_size = shards.world_size
            loose.append(e)
        elif m := rootdir.LEFTOVER_RE.match(name):
            loose.append(_loose(name, path, "partial", f"a removal that did not finish "
                                                        f"({m.group(2)})"))
    qdir = os.path.join(root, QUARANTINE)
    if rootdir.is_real_dir(qdir):
        reasons = quarantine_reasons(root)
        for name in sorted(os.listdir(qdir)):
            path = os.path.join(qdir, name)
            if rootdir.is_real_dir(path):
                e = _loose(name, path, "quarantined", reasons.get(name))
                describe(e)
                loose.append(e)
    loose.sort(key=lambda e: (e.status == "quarantined", -(e.step or 0), e.name))
    return out + loose


def describe(entry: Entry) -> None:
    """Fill time, world size, size and run from the entry's manifest when it parses; never
    fails (a quarantined or partial directory may hold anything)."""
    try:
        entry.manifest = read_manifest(entry.path)
    except ManifestUnreadable:
        return
    set_from_manifest(entry, entry.manifest)


def set_from_manifest(entry: Entry, m: Manifest) -> None:
    entry.time, entry.world_size = m.created, m.world_size
    entry.bytes, entry.run_id = m.total_bytes, m.run_id
    if entry.step is not None and m.step != entry.step:
        entry.note = f"its manifest says step {m.step}"


class ManifestUnreadable(Exception):
    """MANIFEST.json is missing, unreadable or invalid; the message is the operator's sentence.
    ``unsupported``: it is an intact manifest of another format version, not damage."""

    def __init__(self, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


def _other_version(text: bytes) -> bool:
    """Whether ``text`` is a manifest of another mpickpt format version."""
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return (isinstance(d, dict) and d.get("format") == FORMAT
            and d.get("version") not in VERSIONS
            and isinstance(d.get("version"), int))


def read_manifest(path: str) -> Manifest:
    """Read and validate ``path``/MANIFEST.json the way restore does (no symbolic link, at most
    :data:`mpickpt.format.entry.MAX_BYTES`, strict JSON with its checksum)."""
    mpath = os.path.join(path, MANIFEST)
    try:
        text = read_bytes(path)
    except ManifestError as e:
        raise ManifestUnreadable(str(e)) from None
    try:
        return Manifest.from_json(text.decode("utf-8", errors="replace"), mpath).load_all()
    except ManifestError as e:
        raise ManifestUnreadable(str(e), unsupported=_other_version(text)) from None


def root_problem(root: str) -> str | None:
    """Why ``root`` cannot be a ROOT (the operator's sentence), or None: it is a directory."""
    advice = "Give the directory the job checkpoints into (its Checkpointer(ROOT))."
    if os.path.isdir(root):
        return None
    if os.path.islink(root) and not os.path.exists(root):
        return f"{root} is a symbolic link to nothing ({os.readlink(root)}). {advice}"
    if not os.path.lexists(root):
        return f"{root}: no such directory. {advice}"
    what = "a file" if os.path.isfile(root) else "not a directory"
    return f"{root} is {what}, not a checkpoint directory. {advice}"


def locate(path: str) -> tuple[str, str | None]:
    """Split a command-line path into (ROOT, checkpoint directory or None).

    ``ROOT/step-XXXXXXXX``, a partial directory, or ``ROOT/quarantine/NAME`` name one checkpoint;
    any other directory is a ROOT."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if _ANY_STEP_RE.match(name) or os.path.lexists(os.path.join(path, MANIFEST)):
        root = os.path.dirname(parent) if os.path.basename(parent) == QUARANTINE else parent
        return root, path
    return path, None
