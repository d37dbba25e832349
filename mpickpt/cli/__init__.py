"""The operator's tools after a failure: ``mpickpt-restore ROOT`` and ``mpickpt SUBCOMMAND``.

One module per concern: :mod:`.catalog` (what is under ROOT), :mod:`.checks` (quick and full
verification of one checkpoint), :mod:`.team` (verification spread over the ranks of
``mpiexec -n N``), :mod:`.changes` (quarantine, rollback, prune: every change to ROOT),
:mod:`.render` (tables, colour, progress, JSON), and one module per command (:mod:`.restore`,
:mod:`.verify`, :mod:`.inspect`, :mod:`.export`, :mod:`.stats`; :mod:`.main` dispatches).

Exit codes, the same for every command, so that batch scripts can branch on them (3 is left out
on purpose: it is a job's "preempted", :mod:`mpickpt.exitcodes`):

==  ==================================================================================
0   done; a checkpoint that passes verification exists (for ``verify``: every one passes)
1   could not do what was asked (no such step, a file in the way, an I/O error); says why
2   bad command line (argparse)
4   no checkpoint under ROOT passes verification: the job would start from scratch
5   the checkpoint asked about (``--step``, ``inspect``, ``export``), or for ``verify`` at
    least one checkpoint, failed verification; for ``verify``, a good one still exists
==  ==================================================================================

Nothing here unpickles or executes checkpoint data: manifests are strict JSON, shards are read
with positional reads at the manifest's offsets, exactly as restore reads them.
"""

from __future__ import annotations

import argparse

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_CHECKPOINT = 4
EXIT_DAMAGED = 5


def common_options(parser: argparse.ArgumentParser, verify: str = "quick"
                   ) -> argparse.ArgumentParser:
    """The options every command that reads checkpoints takes."""
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (stable keys) instead of the report")
    parser.add_argument("--verify", choices=("quick", "full"), default=verify,
                        help="quick: manifests, shard sizes and records; full: also every "
                        "checksum (all the data is read; in parallel under mpiexec -n N). "
                        f"Default: {verify}")
    parser.add_argument("--threads", type=int, default=4, metavar="N",
                        help="reader threads per process for full verification (default 4)")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                        help="under mpiexec: how long a rank waits for the others (default 3600)")
    return parser
