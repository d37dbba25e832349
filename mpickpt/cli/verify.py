"""Verifying what lies under ROOT, and the two read-only views of it.

``mpickpt ls ROOT`` (= ``mpickpt-restore ROOT --list``) and ``mpickpt verify ROOT`` print one table:
every checkpoint with its step, time, world size, size and status, the one restore will load
marked ``*``. ``verify`` defaults to ``--verify full`` and exits 5 when any committed
checkpoint fails; both exit 4 when none passes. Neither changes anything. ``ls --local LOCAL``
adds the node-local level's steps (:mod:`.local`); the exit code stays ROOT's.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

from ..format import rollback, rootdir
from ..format.rollback import Rollback
from ..log import human_bytes
from . import (
    EXIT_DAMAGED,
    EXIT_ERROR,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    catalog,
    checks,
    diagnose,
    local,
    localshow,
)
from .catalog import Entry
from .changes import active_rollback
from .render import STATUS_STYLE, Cell, Out, human_age, local_time
from .team import Team

LEVELS = {
    "quick": "quick (manifests, shard sizes and records; not the data: --verify full reads "
             "every byte)",
    "full": "full (every checksum of every shard, and its HDF5 metadata)",
}


@dataclass
class Survey:
    root: str
    entries: list[Entry]
    level: str
    checked_bytes: int = 0
    seconds: float = 0.0
    not_shared: dict[str, Any] | None = None  # diagnose.not_shared: ROOT was node-local
    pool: tuple[int, int] = (0, 0)  # ROOT/.pool: retired shard files, bytes allocated

    @property
    def committed(self) -> list[Entry]:
        return [e for e in self.entries
                if e.status in catalog.CHECKED]

    @property
    def current(self) -> Entry | None:
        return next((e for e in self.entries if e.current), None)

    def to_json(self, now: float) -> dict[str, Any]:
        return {"root": self.root, "verify": self.level,
                "current": self.current.step if self.current else None,
                "checked_bytes": self.checked_bytes, "verify_seconds": round(self.seconds, 3),
                "not_shared": self.not_shared,
                "pool": {"files": self.pool[0], "bytes": self.pool[1]},
                "checkpoints": [e.to_json(now) for e in self.entries]}


def survey(root: str, level: str, team: Team, out: Out, chain: bool = False) -> Survey:
    """Check every committed checkpoint quickly, then (``full``) every checksum: of all of them,
    or with ``chain`` newest first until one passes (the one restore will load)."""
    entries = catalog.scan(root)
    committed = [e for e in entries if e.status == "committed"]
    for e in committed:
        checks.quick(e)
    # a job's retention may remove a step between the listing and its check: gone, not damaged
    gone = {e.path for e in committed if e.status != "committed" and not os.path.lexists(e.path)}
    entries = [e for e in entries if e.path not in gone]
    committed = [e for e in committed if e.path not in gone]
    s = Survey(root, entries, level, pool=rootdir.pooled(root))
    if level == "full":
        if chain:
            for e in committed:
                if e.status == "committed":
                    n, t = team.verify([e], out)
                    s.checked_bytes, s.seconds = s.checked_bytes + n, s.seconds + t
                    if e.status in catalog.LOADABLE:
                        break
        else:
            s.checked_bytes, s.seconds = team.verify(committed, out)
    good = next((e for e in committed if e.status in catalog.LOADABLE), None)
    if good is not None:
        good.current = True
    s.not_shared = diagnose.not_shared(
        [(e.path, e.manifest) for e in s.committed],
        [e.path for e in entries if e.status == "partial" and ".partial-" in e.name])
    return s


def show(out: Out, s: Survey, now: float, local_step: int | None = None) -> None:
    """The table of checkpoints, then the problems in full. ``local_step``: the node-local
    level's step that the next restore loads instead of ROOT's (``ls --local``)."""
    out.line(f"{out.style('ROOT', 'bold')} {s.root}")
    out.line(f"verified: {LEVELS[s.level]}")
    if s.level == "full" and s.checked_bytes:
        out.line(f"read {human_bytes(s.checked_bytes)} of tensor data in {s.seconds:.1f} s "
                 f"({human_bytes(s.checked_bytes / max(s.seconds, 1e-6))}/s)")
    rb = active_rollback(s.root)
    if rb is not None:
        back = ", ".join(str(x) for x in rb["undone"])
        out.line(f"rolled back from step {rb.get('from_step')} to step {rb.get('to_step')} "
                 f"by {rb.get('by')} at {local_time(rb.get('time'))} ({catalog.ROLLBACK})"
                 + (f"; partly undone: step(s) {back} moved back into ROOT" if back else ""))
    out.line()
    if not s.entries:
        out.line("no checkpoints (and no partial ones)")
        return
    rows = []
    for e in s.entries:
        note = e.problem.reason if e.problem else (e.note or "")
        rows.append([
            Cell("*", "green bold") if e.current else "",
            "-" if e.step is None else str(e.step),
            local_time(e.time), human_age(None if e.time is None else now - e.time),
            "-" if e.world_size is None else str(e.world_size), human_bytes(e.bytes),
            Cell(e.status, STATUS_STYLE.get(e.status, "")), note,
        ])
    out.table(["", "STEP", "WRITTEN", "AGE", "RANKS", "SIZE", "STATUS", "NOTE"], rows,
              right=(1, 4, 5))
    out.line()
    if s.pool[0]:
        out.line(f"{rootdir.POOL}/: {s.pool[0]} shard file(s) of a retired checkpoint, "
                 f"{human_bytes(s.pool[1])}, which the job's next save writes over "
                 f"(`rm -r {os.path.join(s.root, rootdir.POOL)}` frees them while no job runs)")
    cur = s.current
    if local_step is not None:
        than = ("newer than ROOT's" if cur is None or local_step > cur.step
                else "the step ROOT's newest is too")
        out.line(f"Checkpointer.restore() will load step {local_step} from the node-local "
                 f"level (below), {than}"
                 + (f" (* = step {cur.step}, its fallback)" if cur is not None else ""))
    elif cur is not None:
        out.line(f"* = the checkpoint Checkpointer.restore() will load: step {cur.step}, "
                 f"{cur.path}")
        if s.level == "quick":
            out.line("  (if its data is intact: a quick check reads none of it, --verify full "
                     "reads it all)")
    else:
        out.line(out.style("no checkpoint passes verification: the job would start from "
                           "scratch", "red bold"))
    for e in s.committed:
        for p in e.problems[1:]:
            out.line(f"  step {e.step}, also: {p.reason}")
    if s.not_shared is not None:
        out.line(out.style(f"ROOT NOT SHARED? {s.not_shared['message']}.", "red bold"))


def command(args: argparse.Namespace, out: Out, team: Team, verify_mode: bool) -> int:
    now = time.time()
    root, one = catalog.locate(args.root)
    if one is not None and verify_mode:
        return verify_one(root, one, args, out, team)
    if one is not None:
        why = f"{args.root} is a checkpoint; give its parent directory (ROOT)"
        out.problem(why)
        out.json({"command": "list", "exit_code": EXIT_ERROR, "error": why})
        return EXIT_ERROR
    why = catalog.root_problem(root)
    if why is not None:
        out.problem(why)
        out.json({"command": "verify" if verify_mode else "list", "exit_code": EXIT_ERROR,
                  "error": why})
        return EXIT_ERROR
    s = survey(root, args.verify, team, out)
    bad = [e for e in s.committed if e.status != "committed"]
    code = (EXIT_NO_CHECKPOINT if s.current is None
            else EXIT_DAMAGED if verify_mode and bad else EXIT_OK)
    lv = getattr(args, "local", None)  # ls --local: the node-local level too
    views = team.local_views(lv) if lv is not None else []
    steps = local.pool(views, root) if lv is not None else []
    more = {"local": localshow.to_json(views, steps, root, now)} if lv is not None else {}
    nxt = next_restore(s, steps, rollback.active(root))
    if nxt["level"] == "local" and code == EXIT_NO_CHECKPOINT:
        code = EXIT_OK  # the job resumes from the local level
    out.json({"command": "verify" if verify_mode else "list", "exit_code": code, "error": None,
              **s.to_json(now), "rollback": active_rollback(root), "next_restore": nxt,
              **more})
    show(out, s, now, nxt["step"] if nxt["level"] == "local" else None)
    hdf5 = [e for e in bad if e.status == "hdf5-damaged"]
    corrupt = [e for e in bad if e.status == "corrupt"]
    if corrupt and code != EXIT_NO_CHECKPOINT:
        out.line(f"{len(corrupt)} checkpoint(s) fail verification; restore skips them by "
                 f"itself. `mpickpt-restore {root}` moves the damaged ones into "
                 f"{root}/quarantine/.")
    if len(bad) > len(hdf5) + len(corrupt):
        out.line(f"{len(bad) - len(hdf5) - len(corrupt)} checkpoint(s) restore cannot load "
                 "where they are, and not known to be damaged (their notes say why: "
                 "misnamed, unreadable by this user, another format version); "
                 "`mpickpt-restore` leaves them in place.")
    if hdf5:
        out.line(f"{len(hdf5)} checkpoint(s) have damaged HDF5 metadata: restore still loads "
                 "them (it reads the tensors without HDF5 and they verify), but h5py and h5dump "
                 "cannot read them.")
    if lv is not None:
        localshow.show(out, views, steps, root, lv, now, rollback.active(root))
    return code


def next_restore(s: Survey, steps: list[local.LocalStep], undo: Rollback | None
                 ) -> dict[str, Any]:
    """What ``Checkpointer.restore()`` will load, as the job decides: the newest step of ROOT's
    loadable ones and the local level's (seen here, one it can make whole, not undone by a
    rollback), the local level first at the same step. ``{"step", "level", "path"}``; step None
    when neither has one."""
    cur = s.current
    pick = local.next_restore(steps, undo)
    if pick is not None and (cur is None or cur.step is None or pick.step >= cur.step):
        return {"step": pick.step, "level": "local", "nodes": pick.nodes,
                "path": pick.source.path if pick.source else None}
    if cur is not None:
        return {"step": cur.step, "level": "root", "nodes": None, "path": cur.path}
    return {"step": None, "level": None, "nodes": None, "path": None}


def verify_one(root: str, path: str, args: argparse.Namespace, out: Out, team: Team) -> int:
    """``mpickpt verify ROOT/step-XXXXXXXX``: that checkpoint only (also a quarantined one)."""
    now = time.time()
    e = Entry(os.path.basename(path), path, "committed", catalog.step_of(os.path.basename(path)))
    checks.quick(e)
    if args.verify == "full":
        team.verify([e], out)
    code = EXIT_OK if e.status == "committed" else EXIT_DAMAGED
    out.json({"command": "verify", "exit_code": code, "error": None, "root": root,
              "verify": args.verify, "checkpoints": [e.to_json(now)]})
    if e.problem:
        label = "HDF5-DAMAGED" if e.status == "hdf5-damaged" else "CORRUPT"
        out.line(f"{out.style(label, 'red bold')} {path}")
        for p in e.problems:
            out.line(f"  {p.reason}")
    else:
        out.line(f"{out.style('OK', 'green bold')} {path}: step {e.step}, {e.world_size} "
                 f"rank(s), {human_bytes(e.bytes)}, verified {LEVELS[args.verify]}")
    return code
