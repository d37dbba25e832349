"""mpickpt COMMAND: the operator's tools for the checkpoints of an mpickpt job.

``ls`` (= ``mpickpt-restore ROOT --list``; ``--local LOCAL`` adds the node-local level),
``verify``, ``inspect``, ``export``, ``stats``, ``drain`` (a node-local checkpoint into ROOT), and
``restore`` (= ``mpickpt-restore``). Every command takes ``--json``; the exit codes are those of
:mod:`mpickpt.cli`. Under ``mpiexec -n N`` rank 0 runs the command and the others help verify
(with the local level, each also reports its node's directory, and ``drain`` copies the shards
it holds).
Only ``export`` imports torch (it writes .pt files); the other commands start without it.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__

VERSION = f"mpickpt {__version__}"

EPILOG = """\
exit codes: 0 ok; 1 could not do what was asked; 2 bad command line; 4 no checkpoint passes
verification; 5 the checkpoint asked about (for verify: any checkpoint) fails verification.
Run `mpickpt COMMAND --help` for each command, `mpickpt-restore --help` for restore."""


def parser() -> argparse.ArgumentParser:
    from . import common_options, drain, export, inspect, stats

    p = argparse.ArgumentParser(prog="mpickpt", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=VERSION)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    ls = sub.add_parser("ls", help="every checkpoint with its status (changes nothing)")
    ls.add_argument("root", metavar="ROOT")
    ls.add_argument("--local", metavar="LOCAL",
                    help="also list the node-local level under LOCAL (the job's "
                    "Checkpointer(local=...)): each step, the nodes holding it, whether they hold "
                    "it completely, its redundancy, whether ROOT has it")
    common_options(ls)
    v = sub.add_parser("verify", help="check every checkpoint, every byte by default "
                       "(changes nothing); in parallel under mpiexec -n N")
    v.add_argument("root", metavar="ROOT[/step-XXXXXXXX]")
    common_options(v, verify="full")
    inspect.add_parser(sub)
    export.add_parser(sub)
    stats.add_parser(sub)
    drain.add_parser(sub)
    sub.add_parser("restore", help="= mpickpt-restore (see mpickpt-restore --help)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:  # before the commands' modules are imported: a fraction of that
        print(VERSION)
        return 0
    from . import drain, export, inspect, restore, stats, verify
    from .render import Out
    from .team import Team

    if argv[:1] == ["restore"]:
        return restore.main(argv[1:])
    args = parser().parse_args(argv)
    team = Team(getattr(args, "timeout", 3600.0), getattr(args, "threads", 4))
    out = Out(args.json, quiet=team.rank != 0)
    if args.cmd in ("ls", "verify"):
        return team.lead(team.checked(out, "list" if args.cmd == "ls" else args.cmd, args.root,
                                      lambda: verify.command(args, out, team,
                                                             verify_mode=args.cmd == "verify")))
    module = {"inspect": inspect, "export": export, "stats": stats, "drain": drain}[args.cmd]
    path = args.src if args.cmd == "export" else args.path if args.cmd == "inspect" else args.root
    return team.lead(team.checked(out, args.cmd, path, lambda: module.command(args, out, team)))


if __name__ == "__main__":
    sys.exit(main())
