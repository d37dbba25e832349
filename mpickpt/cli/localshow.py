"""``mpickpt ls ROOT --local LOCAL``: the node-local level as :mod:`mpickpt.cli.local` pooled it,
shown to the operator (a table and sentences) or as JSON; and what to do about a step the node
directories seen do not hold completely."""

from __future__ import annotations

from typing import Any

from ..format.rollback import Rollback
from ..log import human_bytes
from ..ranks import ranks_text
from .local import LocalStep, LocalView, foreign, names_text, node_names, problem, undone
from .render import Cell, Out, human_age, local_time


def to_json(views: list[LocalView], steps: list[LocalStep], root: str, now: float
            ) -> dict[str, Any]:
    return {
        "path": views[0].where if views else None, "error": problem(views),
        "nodes": [{"name": nd.name, "path": nd.path, "root": nd.owner, "process": p,
                   "steps": [s.step for s in nd.steps]}
                  for p, v in enumerate(views) for nd in v.dirs],
        "foreign": [{"node": nd.name, "path": nd.path, "root": owner}
                    for nd, owner in foreign(views, root)],
        "steps": [s.to_json(now) for s in steps],
    }


def _nodes_cell(s: LocalStep) -> str:
    total = len(set(s.layout)) if s.layout else None
    return f"{len(s.nodes)} of {total}" if total else str(len(s.nodes))


def show(out: Out, views: list[LocalView], steps: list[LocalStep], root: str, local: str,
         now: float, undo: Rollback | None = None) -> None:
    """The local level's section of ``mpickpt ls``; ``undo``: ROOT's rollback in effect."""
    out.line()
    names = node_names(views)
    where = views[0].where if views else local
    seen = f" (as {len(views)} processes see it)" if len(views) > 1 else ""
    dirs = f"{len(names)} node director{'y' if len(names) == 1 else 'ies'}"
    out.line(f"{out.style('LOCAL', 'bold')} {where}{seen}: "
             + (f"{dirs} ({names_text(names)})" if names else "no node directory"))
    why = problem(views)
    if why is not None:
        out.line(why)
        return
    for nd, owner in foreign(views, root):
        out.line(out.style(f"{nd.path} holds the checkpoints of ROOT {owner}, not of this "
                           "ROOT", "red bold"))
    out.line()
    if not steps:
        out.line("no committed checkpoint on the nodes")
        return
    rows = []
    gone = undone(steps, undo)
    for s in steps:
        m = s.first
        status = ("undone" if s.step in gone else "complete" if s.complete
                  else "rebuildable" if s.rebuildable
                  else "incomplete" if m is not None else "unreadable")
        note = (f"missing {ranks_text(s.missing)}" if s.missing
                else "" if m is not None else "no node holds a valid manifest")
        if s.notes:
            note = "; ".join(filter(None, [note, *s.notes]))
        rows.append([
            str(s.step), local_time(m.created if m else None),
            human_age(now - m.created if m else None), str(m.world_size) if m else "-",
            human_bytes(m.total_bytes if m else None), s.scheme or "none", _nodes_cell(s),
            Cell(status, "green" if status in ("complete", "rebuildable") else "red"),
            Cell("yes" if s.in_root else "no", "" if s.in_root else "yellow"), note])
    out.table(["STEP", "WRITTEN", "AGE", "RANKS", "SIZE", "REDUNDANCY", "NODES", "STATUS",
               "IN ROOT", "NOTE"], rows, right=(0, 3, 4))
    out.line()
    if gone and undo is not None:
        out.line(f"undone by {undo.describe()}: step(s) {', '.join(map(str, gone))}, saved "
                 "before it; the job's next start discards them on every node")
    newest = steps[0]
    best = next((s for s in steps if s.complete and s.step not in gone), None)
    if best is not None and not best.in_root:
        out.line(f"step {best.step} is complete on the nodes but not in ROOT: `mpickpt drain "
                 f"{where} {root}` copies it there")
    if not newest.complete and not newest.in_root and newest.first is not None:
        homes = sorted({h for r in newest.missing if (h := newest.home(r)) is not None})
        on = f" (their node{'s' if len(homes) > 1 else ''}: {names_text(homes)})" if homes else ""
        then = ("a restart of the job rebuilds them from XOR parity and drains at close()"
                if newest.scheme == "xor" else
                "only node directories not seen here can hold them (`mpickpt drain` says more)")
        out.line(f"step {newest.step} lacks the shards of {ranks_text(newest.missing)}{on}: "
                 f"{then}")


def rebuild_hint(s: LocalStep) -> str:
    """What to do about a step the node directories seen do not hold completely."""
    if s.scheme == "xor":
        return ("Its redundancy is XOR parity: a restart of the job with this local level "
                "rebuilds the missing shards when it restores, and drains the newest local "
                "checkpoint to ROOT at close(). If some nodes were not seen, run this command "
                "with one process on every node (srun --ntasks-per-node=1 mpickpt drain ...)")
    return ("A restart of the job rebuilds XOR-protected shards when it restores and drains at "
            f"close(), but this step's redundancy is {s.scheme or 'none'}: its missing shards "
            "can only come from node directories this command did not see (run it with one "
            "process on every node: srun --ntasks-per-node=1 mpickpt drain ...)")


