"""Every change the tools make under ROOT, planned first (``--dry-run`` stops there), then done.

* **quarantine**: a directory is renamed into ``ROOT/quarantine/`` (same file system, one atomic
  rename, both directories fsynced) and a line saying what, from where, why, when and by whom is
  appended to ``ROOT/quarantine/QUARANTINE.jsonl``. Restore lists only ``ROOT/step-*``, so a
  quarantined checkpoint is never loaded; moving it back by hand undoes the quarantine.
* **delete** (``--delete``, and ``--prune``): :func:`mpickpt.format.rootdir.remove`, which renames
to
  ``*.deleting-<id>`` before removing files, so no crash leaves a half-deleted checkpoint looking
  committed.
* **rollback** (``--step N``): the committed checkpoints newer than N are quarantined, so N is the
  newest and the next ``Checkpointer.restore()`` loads it; ``ROOT/ROLLBACK.json`` (atomic write)
  records who rolled back when, from which step to which, what was moved, and the earlier
  rollbacks. It is written only once every move succeeded; a move that fails moves the ones
  before it back (the oldest is moved first), so that a failed rollback changes nothing.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from ..format import rollback, rootdir
from .catalog import QUARANTINE, QUARANTINE_LOG, ROLLBACK, Entry
from .render import iso_utc

RUN_ID = f"cli{os.getpid()}"  # names this process's *.deleting-* directories


def operator() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


@dataclass
class Action:
    kind: str  # quarantine | delete
    path: str
    step: int | None
    reason: str
    dest: str | None = None  # quarantine: the new path
    done: bool = False
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"action": self.kind, "path": self.path, "step": self.step, "reason": self.reason,
                "to": self.dest, "done": self.done, "error": self.error}


class Changes:
    def __init__(self, root: str, dry_run: bool) -> None:
        self.root, self.dry_run = root, dry_run
        self.qdir = os.path.join(root, QUARANTINE)
        self.actions: list[Action] = []
        self.rollback: dict[str, Any] | None = None

    def _free_name(self, name: str) -> str:
        taken = {os.path.basename(a.dest) for a in self.actions if a.dest}
        candidate, n = name, 1
        while candidate in taken or os.path.lexists(os.path.join(self.qdir, candidate)):
            n += 1
            candidate = f"{name}~{n}"
        return os.path.join(self.qdir, candidate)

    def quarantine(self, entry: Entry, reason: str) -> Action:
        """Plan to move ``entry`` into ROOT/quarantine/."""
        action = Action("quarantine", entry.path, entry.step, reason, self._free_name(entry.name))
        self.actions.append(action)
        return action

    def delete(self, entry: Entry, reason: str) -> Action:
        """Plan to remove ``entry`` for good."""
        action = Action("delete", entry.path, entry.step, reason)
        self.actions.append(action)
        return action

    def roll_back(self, from_step: int | None, to_step: int, moved: list[Action]) -> None:
        """Plan ROLLBACK.json, written after ``moved`` are all done."""
        self.rollback = {"format": "mpickpt-rollback", "version": 1, "time": time.time(),
                         "by": operator(), "from_step": from_step, "to_step": to_step,
                         "moved": moved}

    @property
    def rollback_failed(self) -> bool:
        """Whether a rollback was carried out and failed (its moves then undone)."""
        return self.rollback is not None and not self.dry_run and not all(
            a.done for a in self.rollback["moved"])

    @property
    def failed(self) -> list[Action]:
        return [a for a in self.actions if a.error]

    def apply(self) -> None:
        """Carry out the plan (nothing with dry_run): a rollback's moves first, all or none
        (see the module); then each other action, one that fails recording its error while the
        others go on."""
        if self.dry_run:
            return
        moved: list[Action] = [] if self.rollback is None else self.rollback["moved"]
        done: list[Action] = []
        for a in sorted(moved, key=lambda a: a.step if a.step is not None else -1):
            if not self._do(a):
                for b in reversed(done):  # back into ROOT: the rollback changes nothing
                    try:
                        self._move(b, back=f"the rollback failed at step {a.step}")
                        b.done, b.error = False, f"moved back: the move of step {a.step} failed"
                    except OSError as e:
                        b.error = f"not moved back after step {a.step} failed: {_text(e)}"
                for b in moved:
                    if not b.done and b.error is None:
                        b.error = f"not attempted: the move of step {a.step} failed"
                break
            done.append(a)
        for a in self.actions:
            if a not in moved:
                self._do(a)
        if self.rollback is not None and all(a.done for a in moved):
            self._write_rollback()

    def _do(self, a: Action) -> bool:
        try:
            if a.kind == "quarantine":
                self._move(a)
            else:
                rootdir.remove(a.path, RUN_ID)
            a.done = True
        except OSError as e:
            a.error = _text(e)
        return a.done

    def _move(self, a: Action, back: str | None = None) -> None:
        """Quarantine ``a``'s directory (``back``: move it back into ROOT, and why)."""
        assert a.dest is not None
        if not os.path.lexists(self.qdir):
            os.mkdir(self.qdir, rootdir.DIR_MODE)
            rootdir.fsync_path(self.root)
        if not rootdir.is_real_dir(self.qdir):
            raise NotADirectoryError(0, "is not a directory (it must not be a link)", self.qdir)
        os.rename(*((a.dest, a.path) if back else (a.path, a.dest)))
        rootdir.fsync_path(self.qdir)
        rootdir.fsync_path(self.root)
        rec = {"time": time.time(), "time_iso": iso_utc(time.time()), "by": operator(),
               **({"from": a.path, "to_name": os.path.basename(a.dest), "reason": a.reason}
                  if back is None else
                  {"back": a.path, "from_name": os.path.basename(a.dest), "reason": back}),
               "step": a.step}
        fd = os.open(os.path.join(self.qdir, QUARANTINE_LOG),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, rootdir.FILE_MODE)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def rollback_record(self) -> dict[str, Any] | None:
        if self.rollback is None:
            return None
        r = dict(self.rollback)
        r["time_iso"] = iso_utc(r["time"])
        r["moved"] = [{"step": a.step, "from": a.path, "to": a.dest} for a in r["moved"]]
        return r

    def _write_rollback(self) -> None:
        path = os.path.join(self.root, ROLLBACK)
        record = self.rollback_record()
        assert record is not None
        earlier: list[Any] = []
        try:
            with os.fdopen(rootdir.open_regular(path)) as f:
                prev = json.load(f)
            if isinstance(prev, dict):
                earlier = [*prev.pop("earlier", []), prev]
        except (OSError, ValueError, RecursionError):
            pass
        record["earlier"] = earlier
        rootdir.atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())


def _text(e: OSError) -> str:
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def active_rollback(root: str) -> dict[str, Any] | None:
    """ROOT/ROLLBACK.json while the rollback it records is in effect
    (:mod:`mpickpt.format.rollback`), with ``undone``: the steps moved back into ROOT by hand since
    (the documented undo, ``mv`` from the quarantine); None when there is none, or when every
    checkpoint it moved is back."""
    rb = rollback.active(root)
    return None if rb is None else {**rb.record, "undone": rb.undone}
