"""Every exit code mpickpt gives, in one table: the job's (the run wrapper and the checkpointer)
and the operator tools' (``mpickpt``, ``mpickpt-restore``). The tools leave 3 out on purpose: it
keeps meaning "preempted" for the job itself. docs/using.md, docs/operations.md and
``python -m mpickpt.run --help`` show these tables; a test holds them together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    value: int
    name: str
    meaning: str


JOB = (
    Code(0, "EXIT_OK", "finished"),
    Code(1, "EXIT_FAILED", "failed: an uncaught exception on some rank (the job was aborted)"),
    Code(2, "EXIT_USAGE", "usage: a bad `python -m mpickpt.run` command line, or the script "
         "does not exist"),
    Code(3, "EXIT_PREEMPTED", "preempted: a checkpoint of the current step was committed (or the "
         "time left was too short and the last committed one stands); under Slurm the job was "
         "requeued"),
    Code(75, "EXIT_COLLECTIVE_TIMEOUT", "a collective of the checkpoint protocol missed its "
         "deadline (a rank died or hangs); the job was aborted, the last committed checkpoint "
         "is loadable"),
    Code(130, "EXIT_INTERRUPTED", "interrupted: KeyboardInterrupt on some rank (the job was "
         "aborted)"),
)

TOOLS = (
    Code(0, "EXIT_OK", "done; a checkpoint that passes verification exists (for `verify`: "
         "every one passes)"),
    Code(1, "EXIT_ERROR", "could not do what was asked (no such step, a file in the way, an I/O "
         "error); the message says why"),
    Code(2, "EXIT_USAGE", "bad command line"),
    Code(4, "EXIT_NO_CHECKPOINT", "no checkpoint under ROOT passes verification: the job would "
         "start from scratch"),
    Code(5, "EXIT_DAMAGED", "the checkpoint asked about (`--step`, `inspect`, `export`), or for "
         "`verify` at least one checkpoint, failed verification; for `verify`, a good one may "
         "still exist"),
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 3
EXIT_COLLECTIVE_TIMEOUT = 75
EXIT_INTERRUPTED = 130
# the tools'
EXIT_ERROR = 1
EXIT_NO_CHECKPOINT = 4
EXIT_DAMAGED = 5


def markdown_table(codes: tuple[Code, ...]) -> str:
    """A table of ``codes`` as the docs show it."""
    rows = ["| code | name | meaning |", "| ---: | --- | --- |"]
    rows += [f"| {c.value} | `{c.name}` | {c.meaning} |" for c in codes]
    return "\n".join(rows)
