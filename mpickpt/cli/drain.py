"""``mpickpt drain LOCAL ROOT [--step N]``: commit a checkpoint of the node-local level into ROOT
from the nodes' directories, when the job did not (it was killed before its drain).

The step is ``--step N``, else the newest one that the node directories seen hold completely
(every rank's shard, at the size the manifest records). Every shard is verified (every checksum)
before it is copied; a damaged copy is skipped for another node's copy of the same rank. The
commit is a save's: the shards go into ``ROOT/step-XXXXXXXX.partial-cli<pid>/``, each fsynced;
rank 0 checks that they are all there at their sizes, writes MANIFEST.json (the nodes' bytes,
atomic write), renames the directory into place and fsyncs ROOT. A drain cut short leaves only
the partial directory, which ``mpickpt ls`` shows and the job's next start removes.

Under ``mpiexec``/``srun`` with one process per node (``srun --ntasks-per-node=1 mpickpt drain
...``) each process sees its own node's directory: rank 0 pools what every process holds; each
shard is verified and copied by one process that holds it (its own node's copy first, the bytes
spread evenly), a copy that fails verification is tried from another holder, and rank 0 commits.
ROOT must be one shared directory (checked first).

The commit holds ROOT's writer lock (:mod:`mpickpt.format.rootlock`), as a saving job's rank 0
does: a drain while a job saves into ROOT is refused, naming the holder.

Exit codes: 0 drained, or the step is in ROOT already (nothing done); 1 refused (a node directory
whose OWNER.json names another ROOT, no complete step or the one asked for is incomplete, naming
the missing ranks; a job saving into ROOT; an I/O error); 5 every copy of some rank's shard
fails verification. ROOT is unchanged unless the drain committed. Retention and stats.jsonl are
the job's: drain touches neither.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from ..format import checksum, commit, rootdir, rootlock
from ..format.manifest import NAME as MANIFEST
from ..format.manifest import Manifest
from ..local.nodedir import OWNER
from ..log import human_bytes
from ..ranks import rank_ranges, ranks_text
from . import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, local, localshow
from .changes import RUN_ID
from .drainpart import Copied, CopyJob
from .local import Holder, LocalStep
from .render import Out
from .team import Team


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("drain", help="commit a checkpoint of the node-local level into ROOT "
                       "(the newest complete one); under srun, one process per node",
                       description="\n\n".join(__doc__.split("\n\n")[1:4]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("local", metavar="LOCAL", help="the job's Checkpointer(local=...) directory")
    p.add_argument("root", metavar="ROOT", help="the job's Checkpointer(ROOT)")
    p.add_argument("--step", type=int, metavar="N",
                   help="drain step N (default: the newest the nodes hold completely)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=int, default=4, metavar="N",
                   help="shards verified and copied at once per process (default 4)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                   help="under mpiexec: how long a rank waits for the others (default 3600)")
    return p


class Refused(Exception):
    """The drain cannot be done; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR,
                 missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.code, self.missing = code, missing or []


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    root = os.path.abspath(args.root)
    report: dict[str, Any] = {
        "command": "drain", "local": os.path.abspath(args.local), "root": root, "step": None,
        "path": None, "drained": False, "already_in_root": False, "bytes": 0, "seconds": 0.0,
        "shards": [], "skipped": [], "missing": []}
    try:
        code = _drain(args, root, report, out, team)
    except Refused as e:
        out.problem(str(e))
        code = e.code
        report["error"], report["missing"] = str(e), e.missing
    except OSError as e:  # ROOT not writable, full, ...: a sentence, not a traceback
        final = os.path.join(root, rootdir.step_name(report["step"] or 0))
        there = report["step"] is not None and os.path.lexists(os.path.join(final, MANIFEST))
        why = (f"the drain of step {report['step']} into {root} failed: {e}; "
               + (f"{final} was committed all the same" if there else "nothing was drained"))
        out.problem(why)
        code = EXIT_ERROR
        report["error"] = why
    report.setdefault("error", None)
    out.json({**report, "exit_code": code})
    return code


def _pick(steps: list[LocalStep], want: int | None, where: str, names: str) -> LocalStep:
    """The step to drain: ``want``, else the newest complete one; Refused otherwise."""
    if not steps:
        raise Refused(f"{where}: no committed checkpoint in the node directories seen "
                      f"({names})")
    if want is not None:
        s = next((x for x in steps if x.step == want), None)
        if s is None:
            raise Refused(f"no node directory under {where} holds a committed step {want} "
                          f"(steps on the nodes: {', '.join(str(x.step) for x in steps)})")
        return s
    s = next((x for x in steps if x.complete or x.in_root), None)
    if s is not None:
        return s
    why = "; ".join(f"step {x.step}: {x.missing_text()}" for x in steps)
    raise Refused(f"no checkpoint on the nodes is complete in the node directories seen "
                  f"({names}), nothing was drained: {why}. {localshow.rebuild_hint(steps[0])}",
                  missing=steps[0].missing)


def _drain(args: argparse.Namespace, root: str, report: dict[str, Any], out: Out,
           team: Team) -> int:
    t0 = time.monotonic()
    if os.path.lexists(root) and not os.path.isdir(root):
        raise Refused(f"{root} is not a directory: give the job's ROOT")
    views = team.local_views(args.local)
    where = report["local"] = views[0].where
    why = local.problem(views)
    if why is not None:
        raise Refused(why)
    foreign = local.foreign(views, root)
    if foreign:
        nd, owner = foreign[0]
        k = len(foreign) - 1
        more = f" (and {k} more node director{'y' if k == 1 else 'ies'})" if k else ""
        raise Refused(f"{os.path.join(nd.path, OWNER)}: the node directory {nd.name} holds the "
                      f"checkpoints of ROOT {owner}, not of {os.path.realpath(root)}{more}; "
                      f"nothing was drained. Drain it into its own ROOT (`mpickpt drain "
                      f"{where} {owner}`)")
    names = local.names_text(local.node_names(views))
    steps = local.pool(views, root if os.path.isdir(root) else None)
    s = _pick(steps, args.step, where, names)
    report["step"] = s.step
    final = os.path.join(root, rootdir.step_name(s.step))
    newer = [x for x in steps if x.step > s.step and not x.complete and not x.in_root]
    if s.in_root:
        report["already_in_root"], report["path"] = True, final
        out.line(f"step {s.step} is in ROOT already ({final}): nothing to do")
        for x in newer:
            out.line(f"  step {x.step} on the nodes is newer but incomplete: "
                     f"{x.missing_text()}")
        return EXIT_OK
    if s.first is None or s.source is None or s.digest is None:
        raise Refused(f"step {s.step}: no node directory seen holds a valid manifest of it: "
                      + "; ".join(s.notes))
    if not s.complete:
        raise Refused(f"step {s.step} cannot be drained, nothing was: {s.missing_text()}. "
                      f"{localshow.rebuild_hint(s)}", missing=s.missing)
    data = team.manifest_bytes(s.source.proc, s.source.path)
    if isinstance(data, str) or checksum.digest(data) != s.digest:
        raise Refused(f"{os.path.join(s.source.path, MANIFEST)} changed while the drain was "
                      f"planned ({data if isinstance(data, str) else 'another manifest'}); "
                      "nothing was drained: run the command again")
    manifest = Manifest.from_json(data.decode(), os.path.join(s.source.path, MANIFEST))
    rootdir.make_dirs(root)
    busy, release = rootlock.take(root, logging.getLogger("mpickpt"))
    if busy is not None:
        raise Refused(f"{busy} holds the writer lock of {root}: a job is saving into it now; "
                      "nothing was drained. Drain once the job has ended (its own drain may "
                      "make this one unneeded)")
    try:
        return _commit(s, manifest, data, root, final, newer, report, out, team, t0)
    finally:
        release()


def _commit(s: LocalStep, manifest: Manifest, data: bytes, root: str, final: str,
            newer: list[LocalStep], report: dict[str, Any], out: Out, team: Team,
            t0: float) -> int:
    """The drain's copy and commit of step ``s`` into ROOT, its writer lock held."""
    partial = os.path.join(root, rootdir.partial_name(s.step, RUN_ID))
    if os.path.lexists(partial):
        rootdir.remove(partial, RUN_ID)
    os.mkdir(partial, rootdir.DIR_MODE)
    committed = False
    try:
        copied, skipped = _copy_all(s, manifest, partial, out, team)
        report["skipped"] = skipped
        report["shards"] = [{"rank": r, "from": h.path, "node": h.node, "process": h.proc,
                             "bytes": c.nbytes} for r, (h, c) in sorted(copied.items())]
        _check(partial, manifest)

        def appeared(path: str) -> None:
            raise Refused(f"{path} appeared while step {s.step} was being drained (is the job "
                          "running?); ROOT keeps that one, nothing was drained")

        commit.publish(root, partial, s.step, data, existing=appeared)
        committed = True
    finally:
        if not committed and os.path.lexists(partial):
            rootdir.remove(partial, RUN_ID)
    seconds = time.monotonic() - t0
    nbytes = sum(c.nbytes for _, c in copied.values())
    report.update(drained=True, path=final, bytes=nbytes, seconds=round(seconds, 3))
    by_node: dict[str, list[int]] = {}
    for r, (h, _) in copied.items():
        by_node.setdefault(h.node, []).append(r)
    src = ", ".join(f"{n} ({ranks_text(rs)})" for n, rs in sorted(by_node.items()))
    out.line(f"drained step {s.step} into {final}: {len(copied)} shard(s), "
             f"{human_bytes(nbytes)} in {seconds:.2f} s, from {src}")
    for k in skipped:
        out.line(f"  skipped a damaged copy: {k['reason']}")
    for x in newer:
        out.line(f"  step {x.step} on the nodes is newer but incomplete: "
                 f"{x.missing_text()}")
    return EXIT_OK


def _copy_all(s: LocalStep, m: Manifest, partial: str, out: Out, team: Team
              ) -> tuple[dict[int, tuple[Holder, Copied]], list[dict[str, Any]]]:
    """Every rank's shard verified and copied into ``partial`` by a process that holds it, in
    rounds: a copy that fails verification is tried from the next holder. Refused when a rank
    has no intact copy or a copy fails."""
    assert s.digest is not None
    sizes = {r.rank: r.bytes for r in m.ranks}
    tried: dict[int, list[Holder]] = {r: [] for r in sizes}
    damaged: dict[int, list[str]] = {r: [] for r in sizes}
    copied: dict[int, tuple[Holder, Copied]] = {}
    skipped: list[dict[str, Any]] = []
    pending = sorted(sizes, key=lambda r: -sizes[r])
    while pending:
        load = [0] * team.size
        shares: list[list[CopyJob]] = [[] for _ in range(team.size)]
        chosen: dict[tuple[int, str], Holder] = {}
        for r in pending:
            cands = [h for h in s.holders[r] if h not in tried[r]]
            if not cands:
                lost = [x for x in pending if not [h for h in s.holders[x]
                                                   if h not in tried[x]]]
                why = "; ".join(d for x in lost for d in damaged[x])
                raise Refused(f"step {s.step} cannot be drained, nothing was: every copy of the "
                              f"shard of {ranks_text(lost)} seen on the nodes fails "
                              f"verification: {why}", EXIT_DAMAGED, missing=lost)
            home = s.home(r)
            h = min(cands, key=lambda h: (h.node != home, load[h.proc], h.proc, h.node))
            load[h.proc] += sizes[r]
            shares[h.proc].append(CopyJob(r, h.path, os.path.join(partial, m.ranks[r].file),
                                          s.digest))
            chosen[(r, h.path)] = h
        label = "draining" if team.size == 1 else f"draining (rank 0's share of {team.size})"
        progress = out.progress(label, load[0])
        results = team.copy(shares, progress)
        progress.close()
        errors = [c.error for c in results if c.error is not None]
        if errors:
            raise Refused(f"step {s.step} could not be drained, ROOT is unchanged: "
                          + "; ".join(errors))
        pending = []
        for c in results:
            h = chosen[(c.rank, c.src)]
            if c.damaged is not None:
                tried[c.rank].append(h)
                damaged[c.rank].append(c.damaged)
                skipped.append({"rank": c.rank, "file": c.src, "node": h.node,
                                "reason": c.damaged})
                pending.append(c.rank)
            else:
                copied[c.rank] = (h, c)
        pending.sort(key=lambda r: -sizes[r])
    return copied, skipped


def _check(partial: str, m: Manifest) -> None:
    """Rank 0: every rank's shard is in ``partial`` as it sees it, at its size (under mpiexec a
    ROOT that is not shared leaves them elsewhere)."""
    found = commit.presence(partial, m.ranks)
    missing = sorted(found.missing + found.wrong_size)
    if missing:
        raise Refused(f"the shards of ranks {rank_ranges(missing)} were copied but are not in "
                      f"{partial} at their sizes as rank 0 of this command sees it; nothing was "
                      f"drained: {rootdir.NOT_SHARED_ADVICE}")
