"""``mpickpt-restore ROOT``: which checkpoint will the job come back from, is it sound, and tidy up.

1. Every committed checkpoint is checked quickly (manifest, shard sizes, records); with
   ``--verify full`` the newest ones are read in full, newest first, until one passes.
2. Partial directories of dead runs (``*.partial-*``, ``*.deleting-*`` untouched for ``--grace``
   seconds, and none while a job holds ROOT's writer lock) and committed checkpoints that fail
   verification are moved into ``ROOT/quarantine/`` (removed instead with ``--delete``).
   Restore would skip them anyway; out of the way, they no longer cost a failed read at every
   start, and nobody mistakes them for good ones.
3. ``--step N`` rolls back: every committed checkpoint newer than N is quarantined, so N is the
   newest and the next ``Checkpointer.restore()`` loads it; ``ROOT/ROLLBACK.json`` records it.
4. ``--prune --keep N`` removes the good committed checkpoints that no rule of the retention
   policy keeps (:mod:`mpickpt.save.retention`, the Checkpointer's own): the N newest, with
   ``--keep-every K`` every step divisible by K, with ``--best METRIC[:min|max] --keep-best M``
   the M best by that number in the checkpoints' metadata; the chosen one always stays, read in
   full first whatever ``--verify`` says (newest first until one passes). The report
   says why each one is kept. Neither 3 nor 4 runs while a job holds ROOT's writer lock (refused
   at once, nothing changed); each holds the lock while it changes ROOT.
5. The report: step, age, world size, size and path of the checkpoint the job will resume from,
   what was done, and what to run next. Exit 0, or 4 when no checkpoint passes (see
   :mod:`mpickpt.cli` for every code).

``--list`` only prints the table (see :mod:`.verify`); ``--dry-run`` plans and changes nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .. import __version__
from ..format import rollback, rootdir, rootlock
from ..log import human_bytes
from ..save import retention
from . import (
    EXIT_DAMAGED,
    EXIT_ERROR,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    catalog,
    common_options,
    local,
    verify,
)
from .changes import Changes
from .pruning import Pruning, describe_policy, prune, referenced, stranded
from .render import Out, human_age, local_time
from .team import Team

EPILOG = """\
exit codes: 0 a good checkpoint exists (the job resumes from it); 1 could not do what was
asked (message says why); 2 bad command line; 4 no checkpoint passes verification (the job
would start from scratch); 5 the checkpoint given with --step fails verification.

examples:
  mpickpt-restore /scratch/run42                    # check, quarantine what is broken, report
  mpickpt-restore /scratch/run42 --list             # the table; changes nothing
  mpiexec -n 8 mpickpt-restore /scratch/run42 --verify full    # read every byte, 8 readers
  mpickpt-restore /scratch/run42 --step 1200 --dry-run         # what a rollback would do
  mpickpt-restore /scratch/run42 --prune --keep 2              # free space by hand
  mpickpt-restore /scratch/run42 --prune --keep 2 --keep-every 1000 --best val_loss --keep-best 3
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpickpt-restore", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find the newest checkpoint under ROOT that passes verification, move "
        "broken and partial ones into ROOT/quarantine/, and say how to resume.")
    p.add_argument("--version", action="version", version=f"mpickpt {__version__}")
    p.add_argument("root", metavar="ROOT", help="the checkpoint directory (Checkpointer(ROOT))")
    p.add_argument("--list", action="store_true",
                   help="print a table of every checkpoint and its status; change nothing")
    common_options(p)
    p.add_argument("--step", type=int, metavar="N",
                   help="roll back to step N: quarantine every committed checkpoint newer than "
                   "N, so that the next restore() loads N (recorded in ROOT/ROLLBACK.json); "
                   "refused while a job holds ROOT's writer lock")
    p.add_argument("--prune", action="store_true",
                   help="remove the good committed checkpoints that no rule below keeps (the "
                   "one restore would load always stays, read in full first: newest first "
                   "until one passes); the report says why each one is kept; refused while "
                   "a job holds ROOT's writer lock")
    p.add_argument("--keep", type=int, metavar="N",
                   help="with --prune: keep the N newest good ones (>= 1)")
    p.add_argument("--keep-every", type=int, metavar="K",
                   help="with --prune: also keep every step divisible by K, for good")
    p.add_argument("--best", metavar="METRIC[:min|max]",
                   help="with --prune and --keep-best: rank the checkpoints by the number "
                   "METRIC in their metadata (save(..., metadata=...)), lowest best (min, the "
                   "default) or highest (max); one without a finite number there is not ranked")
    p.add_argument("--keep-best", type=int, metavar="M", default=0,
                   help="with --prune and --best: also keep the M best")
    p.add_argument("--local", metavar="LOCAL",
                   help="the job's node-local level (Checkpointer(local=...)): the report says "
                   "which step the job will load when the nodes hold a newer one than ROOT, "
                   "and which of their steps a rollback undoes (under srun with one process "
                   "per node, every node's directory is seen)")
    p.add_argument("--delete", action="store_true",
                   help="remove broken and partial directories instead of quarantining them")
    p.add_argument("--dry-run", action="store_true", help="say what would be done; do nothing")
    p.add_argument("--grace", type=float, default=900.0, metavar="S",
                   help="leave partial directories written in the last S seconds alone: a job "
                   "may still be writing them (default 900, the protocol's default deadline)")
    return p


def policy(p: argparse.ArgumentParser, args: argparse.Namespace) -> retention.Policy | None:
    """The retention policy of --prune and its options (None without --prune); exits 2 with
    the option to fix when they do not make one."""
    rules = args.keep_every is not None or args.best is not None or args.keep_best
    if args.prune != (args.keep is not None):
        p.error("--prune and --keep N go together")
    if rules and not args.prune:
        p.error("--keep-every, --best and --keep-best go with --prune --keep N")
    if not args.prune:
        return None
    for flag, value in (("--keep", args.keep), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    if args.keep_best < 0:
        p.error(f"--keep-best must be at least 0, not {args.keep_best}")
    if (args.best is None) != (args.keep_best == 0):
        p.error("--best METRIC[:min|max] and --keep-best M go together")
    metric, mode = args.best, "min"
    if metric is not None and ":" in metric:
        metric, mode = metric.rsplit(":", 1)
        if mode not in ("min", "max"):
            p.error(f"--best {args.best}: the part after the last ':' must be min or max "
                    f"(a metadata key with ':' in it: --best {args.best}:min)")
    if metric is not None and not metric:
        p.error("--best needs the name of a number in the checkpoints' metadata")
    pol = retention.Policy(args.keep, args.keep_every, metric, mode, args.keep_best)
    try:
        pol.check()
    except ValueError as e:
        p.error(str(e))
    return pol


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.policy = policy(p, args)
    if args.list and (args.step is not None or args.prune or args.delete):
        p.error("--list changes nothing; run --step, --prune or --delete without it")
    team = Team(args.timeout, args.threads)
    out = Out(args.json, quiet=team.rank != 0)
    if args.list:
        return team.lead(team.checked(out, "list", args.root,
                                      lambda: verify.command(args, out, team, verify_mode=False)))
    return team.lead(team.checked(out, "restore", args.root, lambda: command(args, out, team)))


def fail(out: Out, code: int, message: str, **extra: Any) -> int:
    out.problem(message)
    out.json({"command": "restore", "exit_code": code, "error": message, **extra})
    return code


def job_saving(holder: str, root: str, rolling: bool) -> str:
    """Why a rollback or a prune is refused while a job holds ROOT's writer lock."""
    what = "rolling back" if rolling else "pruning"
    return (f"{holder} holds the writer lock of {root}: a job is saving into it now (or "
            f"another mpickpt command is changing it), and {what} meanwhile could hide or "
            "remove a checkpoint it writes, refers to or resumes from. Nothing was changed; "
            "run this once it has ended (--dry-run shows the plan meanwhile)")


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    now = time.time()
    root, one = catalog.locate(args.root)
    if one is not None:
        return fail(out, EXIT_ERROR, f"{args.root} is one checkpoint; give its parent directory "
                    "(ROOT), or inspect it with `mpickpt inspect`")
    why = catalog.root_problem(root)
    if why is not None:
        return fail(out, EXIT_ERROR, why, root=root)
    rolling = args.step is not None
    # a rollback or a prune while a job saves into ROOT could hide or remove what the job
    # writes, refers to or resumes from: refused now, and again should a job start meanwhile
    guarded = (rolling or args.policy is not None) and not args.dry_run
    if guarded and not rootlock.free(root):
        return fail(out, EXIT_ERROR, job_saving(rootlock.who(root), root, rolling), root=root)
    seen = rootdir.committed(root)  # what the plan is made from
    # a prune deletes what restore would fall back to: the one it keeps as the resume point is
    # read in full first (a quick check reads none of its data), newest first until one passes
    full = args.verify == "full" or args.policy is not None
    s = verify.survey(root, "quick" if rolling else "full" if full else "quick", team, out,
                      chain=True)
    live = None if rootlock.free(root) else rootlock.who(root)  # as it is after the survey
    changes = Changes(root, args.dry_run)
    left_alone = []
    held = stranded(s)  # node-local ROOT: what may hold the only copy of some rank's shards
    for path, why in held.items():
        left_alone.append({"path": path, "reason": (
            f"{why} (ROOT NOT SHARED?, below): left in place, so that the shards can be "
            "brought together")})
    for e in s.entries:
        if e.status != "partial" or e.path in held:
            continue
        age = now - (e.modified if e.modified is not None else now)
        if live is not None:
            left_alone.append({"path": e.path, "reason": (
                f"{live} holds ROOT's writer lock: a job is saving into it now, and may be "
                "writing this one")})
        elif age < args.grace:
            left_alone.append({"path": e.path, "reason": (
                f"written {human_age(age)}: a job may still be writing it; once the job is "
                "known to be dead, rerun with --grace 0")})
        else:
            why = f"{e.note}; last written {human_age(age)}"
            (changes.delete if args.delete else changes.quarantine)(e, why)
    chosen = s.current
    if rolling:
        target = next((e for e in s.committed if e.step == args.step), None)
        if target is None:
            steps = ", ".join(str(e.step) for e in s.committed) or "none"
            where = [e.path for e in s.entries if e.step == args.step and e.status != "partial"]
            hint = (f" ({where[0]} is quarantined; if it is good, put it back with `mv "
                    f"{where[0]} {root}/{rootdir.step_name(args.step)}`)") if where else ""
            return fail(out, EXIT_ERROR, f"no committed checkpoint of step {args.step} under "
                        f"{root}{hint}; committed steps: {steps}. Nothing was changed.", root=root)
        if full:
            s.checked_bytes, s.seconds = team.verify([target], out)
            s.level = "full"
        if target.status == "corrupt":
            assert target.problem is not None
            return fail(out, EXIT_DAMAGED, f"step {args.step} fails verification: "
                        f"{target.problem.reason}. Nothing was changed; choose another step "
                        f"(`mpickpt-restore {root} --list`).", root=root,
                        checkpoints=[e.to_json(now) for e in s.entries])
        for e in s.entries:
            e.current = e is target
        chosen = target
        newer = [e for e in s.committed if e.step is not None and e.step > args.step]
        moved = [changes.quarantine(e, f"rolled back to step {args.step}" +
                                    (f"; it also fails verification: {e.problem.reason}"
                                     if e.problem else "")) for e in newer]
        # recorded even when ROOT holds nothing newer: the node-local level may
        changes.roll_back(s.committed[0].step, args.step, moved)
    planned = {a.path for a in changes.actions}
    needed = referenced(s, planned)
    for e in s.committed:
        if e.status == "corrupt" and e.path not in planned and e.step in needed:
            assert e.problem is not None
            left_alone.append({"path": e.path, "reason": (
                f"{e.problem.reason}: left in place, since step {needed[e.step]} (which "
                "verifies) refers to its files")})
            planned.add(e.path)
        if e.status == "unsupported" and e.path not in planned:
            assert e.problem is not None
            left_alone.append({"path": e.path, "reason": (
                f"{e.problem.reason}: not damaged, so left in place; this mpickpt cannot "
                "load it")})
        if e.status == "unreadable" and e.path not in planned:
            assert e.problem is not None
            left_alone.append({"path": e.path, "reason": (
                f"{e.problem.reason}: this user may not read it, which says nothing of its "
                "bytes, so it is left in place; run this as the job's user")})
        if e.status == "misnamed" and e.path not in planned:
            assert e.problem is not None
            left_alone.append({"path": e.path, "reason": (
                f"{e.problem.reason}: left in place, intact")})
        if e.status == "hdf5-damaged" and e.path not in planned:
            assert e.problem is not None
            left_alone.append({"path": e.path, "reason": (
                f"{e.problem.reason}: restore still loads it, so it is left in place")})
        if e.status == "corrupt" and e.path not in planned and e.path not in held:
            assert e.problem is not None
            (changes.delete if args.delete else changes.quarantine)(e, e.problem.reason)
    if args.prune and chosen is None:
        out.problem("--prune: nothing pruned, since no checkpoint passes verification")
    pruning = None
    if args.policy is not None and chosen is not None:
        pruning = prune(s, chosen, changes, args.policy)
    busy, release = rootlock.take(root, logging.getLogger("mpickpt")) if guarded \
        else (None, lambda: None)
    if busy is not None:
        return fail(out, EXIT_ERROR, job_saving(busy, root, rolling), root=root)
    if guarded and rootdir.committed(root) != seen:  # a job saved (and ended) meanwhile
        release()
        return fail(out, EXIT_ERROR, f"the committed checkpoints under {root} changed while "
                    "this command looked at them (a job saved into it meanwhile). Nothing was "
                    "changed; run it again", root=root)
    try:
        changes.apply()
    finally:
        release()
    if changes.rollback_failed:  # undone: restore loads what it did
        s = verify.survey(root, "full" if full else "quick", team, out, chain=True)
        chosen = s.current
    lv = LocalLook(args.local, team, root, changes, args.dry_run)
    # after a rollback, s.current is its target, and lv.undo the rollback (planned, if a dry run)
    nxt = verify.next_restore(s, lv.steps, lv.undo)
    code = EXIT_OK if chosen is not None or nxt["level"] == "local" else EXIT_NO_CHECKPOINT
    if changes.failed:
        code = EXIT_ERROR
    resume = None
    if nxt["step"] is not None:
        ranks = chosen.world_size if chosen is not None and nxt["level"] == "root" else \
            lv.world_size(nxt["step"])
        resume = {"step": nxt["step"], "level": nxt["level"], "world_size": ranks,
                  "path": nxt["path"],
                  "command": f"mpiexec -n {ranks} <the job's command line, unchanged>",
                  "python": f"ckpt.restore(state, step={nxt['step']})"}
    out.json({"command": "restore", "exit_code": code, "error": None, "dry_run": args.dry_run,
              **s.to_json(now), "chosen": chosen.to_json(now) if chosen else None,
              "resume": resume, "next_restore": nxt,
              "local": {"undone": lv.gone, "path": args.local} if args.local else None,
              "actions": [a.to_json() for a in changes.actions],
              "left_alone": left_alone, "rollback": changes.rollback_record(),
              "retention": pruning.to_json() if pruning else None})
    report(out, s, chosen, changes, left_alone, args, now, pruning, nxt, lv)
    return code


class LocalLook:
    """``--local``: the node-local level's steps as the processes of the command see them, and
    the rollback in effect after this command's changes (a dry run's planned one included)."""

    def __init__(self, path: str | None, team: Team, root: str, changes: Changes,
                 dry_run: bool) -> None:
        self.path = path
        views = team.local_views(path) if path is not None else []
        self.steps = local.pool(views, root) if path is not None else []
        self.undo = rollback.active(root)
        record = changes.rollback_record()
        if dry_run and record is not None:
            self.undo = rollback.Rollback(record["to_step"], record["time"], record["by"])
        self.gone = local.undone(self.steps, self.undo)

    def world_size(self, step: int) -> int | None:
        s = next((x for x in self.steps if x.step == step), None)
        return s.first.world_size if s is not None and s.first is not None else None


def report(out: Out, s: verify.Survey, chosen: catalog.Entry | None, changes: Changes,
           left_alone: list[dict[str, str]], args: argparse.Namespace, now: float,
           pruning: Pruning | None, nxt: dict[str, Any], lv: LocalLook) -> None:
    out.line(f"{out.style('ROOT', 'bold')} {s.root}")
    if changes.actions:
        out.line()
        out.line("would do (dry run, nothing was changed):" if args.dry_run else "done:")
        verbs = {"quarantine": "quarantined", "delete": "removed"}
        for a in changes.actions:
            verb = f"would {a.kind}" if args.dry_run else verbs[a.kind]
            if a.error:
                verb = f"FAILED to {a.kind}"
            name = a.path[len(s.root) + 1:]
            out.line(f"  {out.style(f'{verb:<16}', 'red' if a.error else 'yellow')} {name}")
            out.line(f"  {'':16} {a.reason}")
            if a.dest:
                out.line(f"  {'':16} -> {a.dest}")
            if a.error:
                out.line(f"  {'':16} {out.style(a.error, 'red')}")
    record = changes.rollback_record()
    failed = changes.rollback_failed
    if record is not None and not args.dry_run and not failed:
        out.line(f"  rolled back from step {record['from_step']} to step "
                 f"{record['to_step']}: recorded in {s.root}/{catalog.ROLLBACK}")
    elif failed:
        out.line(out.style(f"  the rollback to step {record['to_step']} failed (above): the "
                           "steps it had moved are back in ROOT, nothing was rolled back",
                           "red bold"))
    if record is not None and lv.path is None and not failed:
        out.line(f"  a node-local level's steps newer than {record['to_step']}, saved before "
                 "now, are undone too: the job discards them at its next start")
    if lv.gone:
        out.line(f"  the node-local level {lv.path}: step(s) {', '.join(map(str, lv.gone))} "
                 f"{'would be' if args.dry_run else 'are'} undone by the rollback; the job "
                 "discards them at its next start")
    if pruning is not None:
        out.line()
        out.line(f"kept by the retention policy ({describe_policy(pruning.policy)}):")
        for st, why in pruning.kept.items():
            out.line(f"  step {st:<10} {why}")
        if pruning.unranked:
            out.line(f"  not ranked by --best (no finite number {pruning.policy.best!r} in "
                     f"their metadata): step(s) {', '.join(map(str, pruning.unranked))}")
    if left_alone:
        out.line()
        out.line("left alone:")
        for item in left_alone:
            out.line(f"  {item['path'][len(s.root) + 1:]}")
            out.line(f"    {item['reason']}")
    if s.not_shared is not None:
        out.line()
        out.line(out.style(f"ROOT NOT SHARED? {s.not_shared['message']}.", "red bold"))
    if changes.failed:
        out.line()
        out.line(out.style("some changes failed (above): fix the cause (permissions? a full "
                           "disk?) and run the same command again", "red bold"))
    out.line()
    if nxt["level"] == "local":
        ranks = lv.world_size(nxt["step"])
        out.line(f"{out.style('GOOD', 'green bold')}  the job will resume from step "
                 f"{out.style(str(nxt['step']), 'bold')}, from the node-local level "
                 f"{lv.path} (" + ("newer than ROOT's)" if chosen is None else
                                   f"newer than ROOT's step {chosen.step}, its fallback)"
                                   if nxt["step"] > chosen.step else
                                   f"ROOT's step {chosen.step} too, its fallback)"))
        out.line(f"  nodes     {', '.join(nxt['nodes'] or [])}")
        out.line(f"  ranks     {ranks}")
        out.line()
        out.line(f"next: start the job again exactly as before, on {ranks} rank(s) and the same "
                 "nodes' local directories;")
        out.line(f"Checkpointer.restore(state) loads step {nxt['step']}.")
        return
    if chosen is None:
        out.line(out.style(f"NO GOOD CHECKPOINT under {s.root}: the job would start from "
                           "scratch", "red bold"))
        if s.committed or any(e.status == "quarantined" for e in s.entries):
            out.line(f"  `mpickpt-restore {s.root} --list` shows what is there and why each "
                     "one failed;")
            out.line("  `mpickpt inspect DIR` shows what a quarantined one holds.")
        return
    if s.level == "quick":
        level = ("quick (manifest, shard sizes and records): restore still checks every "
                 "block and falls back\n"
                 f"            by itself; --verify full reads all {human_bytes(chosen.bytes)} "
                 "now")
    else:
        level = verify.LEVELS["full"]
    out.line(f"{out.style('GOOD', 'green bold')}  the job will resume from step "
             f"{out.style(str(chosen.step), 'bold')}")
    out.line(f"  path      {chosen.path}")
    out.line(f"  written   {local_time(chosen.time)} ({human_age(now - (chosen.time or now))})")
    out.line(f"  ranks     {chosen.world_size}")
    out.line(f"  size      {human_bytes(chosen.bytes)} in {chosen.world_size} shard(s)")
    out.line(f"  verified  {level}")
    out.line()
    out.line(f"next: start the job again exactly as before, on {chosen.world_size} rank(s):")
    out.line(f"  mpiexec -n {chosen.world_size} <the job's command line, unchanged>")
    out.line(f"Checkpointer.restore(state) loads step {chosen.step}; to insist on it: "
             f"restore(state, step={chosen.step}).")
    if args.step is not None and left_alone:
        out.line(out.style(f"a job may be running (see 'left alone'): stop it first, or its "
                           f"next checkpoint will be newer than step {args.step}", "yellow"))


if __name__ == "__main__":
    sys.exit(main())
