"""The operator's tools after a failure: ``mpickpt-restore ROOT`` and ``mpickpt SUBCOMMAND``.

One module per concern: :mod:`.catalog` (what is under ROOT), :mod:`.checks` (quick and full
verification of one checkpoint), :mod:`.team` (verification spread over the ranks of
``mpiexec -n N``), :mod:`.changes` (quarantine, rollback, prune: every change to ROOT),
:mod:`.render` (tables, colour, progress, JSON), :mod:`.local` (the node-local level's
directories), and one module per command (:mod:`.restore`, :mod:`.verify`, :mod:`.inspect`,
:mod:`.export`, :mod:`.stats`, :mod:`.drain`; :mod:`.main` dispatches).

Exit codes, the same for every command, so that batch scripts can branch on them:
:data:`mpickpt.exitcodes.TOOLS` (0 done, 1 could not, 2 bad command line, 4 no good checkpoint,
5 the checkpoint asked about is damaged; never 3, the job's "preempted").

Nothing here unpickles or executes checkpoint data: manifests are strict JSON, shards are read
with positional reads at the manifest's offsets, exactly as restore reads them.
"""

from __future__ import annotations

import argparse

from ..exitcodes import EXIT_DAMAGED, EXIT_ERROR, EXIT_NO_CHECKPOINT, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "EXIT_NO_CHECKPOINT", "EXIT_OK", "EXIT_USAGE",
           "common_options"]


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
