"""``ROOT/ROLLBACK.json``: an operator's rollback, and the rule every level obeys because of it.

``mpickpt-restore ROOT --step N`` quarantines ROOT's checkpoints newer than N and records the
rollback here (:mod:`mpickpt.cli.changes` writes it). ROOT then holds nothing newer than N, but
the node-local level may: steps saved before the rollback and never drained, or drained and
quarantined in ROOT since. The rule, applied alike by ``Checkpointer.restore()`` (which then
discards those steps on every node) and by the tools that predict what it loads:

    a local step newer than N whose manifest was written before the rollback is not loaded.

Steps saved after the rollback (by the job that resumed from N) are newer than it and count as
usual. A rollback is in effect while its file is there and not every step it moved is back in
ROOT (moving them back by hand from ``ROOT/quarantine/`` is the documented undo).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from . import rootdir

NAME = "ROLLBACK.json"
QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Rollback:
    """The rollback in effect: to ``to_step``, made at ``time`` (Unix time) by ``by``."""

    to_step: int
    time: float
    by: str = ""
    from_step: int | None = None
    undone: list[int] = field(default_factory=list)  # steps moved back into ROOT by hand
    record: dict[str, Any] = field(default_factory=dict, repr=False)

    def excludes(self, step: int, written: float | None) -> bool:
        """Whether a node-local step written at ``written`` (its manifest's time; None: unknown,
        taken as before) is undone by this rollback."""
        return step > self.to_step and (written is None or written < self.time)

    def describe(self) -> str:
        return (f"{NAME} rolled back to step {self.to_step}"
                + (f" by {self.by}" if self.by else ""))


def read_record(root: str) -> dict[str, Any] | None:
    """The JSON object of ``ROOT/ROLLBACK.json``, or None (absent, unreadable or not an object;
    never through a link)."""
    try:
        with os.fdopen(rootdir.open_regular(os.path.join(root, NAME))) as f:
            r = json.load(f)
        return r if isinstance(r, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def undone_steps(root: str, record: dict[str, Any]) -> tuple[list[Any], bool]:
    """(the steps of ``record`` moved back into ROOT by hand, whether every one it moved is)."""
    moved = record.get("moved")
    undone: list[Any] = []
    if not isinstance(moved, list):
        return undone, False
    for m in moved:
        try:
            src, dst = os.path.basename(m["from"]), os.path.basename(m["to"])
        except (KeyError, TypeError):
            continue
        if rootdir.is_real_dir(os.path.join(root, src)) and \
                not os.path.lexists(os.path.join(root, QUARANTINE, dst)):
            undone.append(m.get("step"))
    return undone, bool(moved) and len(undone) == len(moved)


def active(root: str) -> Rollback | None:
    """The rollback in effect under ``root``, or None."""
    record = read_record(root)
    if record is None:
        return None
    undone, all_back = undone_steps(root, record)
    to_step, when = record.get("to_step"), record.get("time")
    if all_back or not isinstance(to_step, int) or not isinstance(when, (int, float)) \
            or not math.isfinite(when):  # (a damaged record: as if none)
        return None
    by = record.get("by")
    frm = record.get("from_step")
    return Rollback(to_step, float(when), by if isinstance(by, str) else "",
                    frm if isinstance(frm, int) else None,
                    [u for u in undone if isinstance(u, int)], record)
