"""Every environment variable mpickpt reads, declared once: name, default, type and one line of
doc. Modules read them through these objects only (``knobs.TIMEOUT.get()``), and the table in
docs/using.md is :func:`markdown_table`'s output (a test holds the two together).

A value that cannot be parsed is a ValueError naming the variable: a typo must not silently
turn a deadline or a fault into its default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a positive number of seconds")
    return value


def _non_negative(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError("must be a number of seconds, 0 or more")
    return value


def _flag(raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw.strip() == "1"


def _level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _signal(raw: str) -> str:
    name = raw.strip().upper()
    return name if name.startswith("SIG") else "SIG" + name


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable."""

    name: str
    default: T
    parse: Callable[[str], T]
    kind: str
    doc: str

    def get(self, env: Mapping[str, str] = os.environ) -> T:
        """Its value in ``env`` (the process environment by default); unset or empty: the
        default."""
        raw = env.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            reason = str(e) if "could not convert" not in str(e) else f"expected {self.kind}"
            raise ValueError(f"{self.name}={raw!r}: {reason}") from None


TIMEOUT = Knob("MPICKPT_TIMEOUT", 900.0, _seconds, "seconds",
               "deadline of every collective of the checkpoint protocol (Checkpointer(timeout=) "
               "wins); a missed one aborts the job with exit code 75")
TIMEOUT_GRACE = Knob("MPICKPT_TIMEOUT_GRACE", 5.0, _seconds, "seconds",
                     "how long the roll call after a missed deadline waits for the ranks' answers")
DEADLINE = Knob[float | None]("MPICKPT_DEADLINE", None, float, "Unix time",
                              "when the job will be killed (else $SLURM_JOB_END_TIME): an "
                              "emergency checkpoint that cannot finish by then is skipped")
REQUEUE = Knob("MPICKPT_REQUEUE", True, _flag, "0 or 1",
               "0: a preempted job under Slurm is not requeued by rank 0")
SIGNAL = Knob("MPICKPT_SIGNAL", "SIGUSR2", _signal, "a signal name",
              "the preemption signal (SIGTERM is always watched too)")
LOG = Knob("MPICKPT_LOG", "INFO", _level, "a log level",
           "level of the 'mpickpt' logger when the application configured none")
EXIT_GRACE = Knob("MPICKPT_EXIT_GRACE", 30.0, _non_negative, "seconds",
                  "mpickpt.run: how long a rank that exits non-zero waits for the others before "
                  "it aborts the job")
READY_FILE = Knob[str | None]("MPICKPT_READY_FILE", None, str, "a path",
                              "rank 0 creates it once every rank has reached should_exit (so "
                              "every rank watches the preemption signals); slurm/train.sbatch "
                              "holds an early signal until then")
ABORT_DELAY = Knob("MPICKPT_ABORT_DELAY", 1.0, _non_negative, "seconds",
                   "mpickpt.run: pause between printing a traceback and MPI_Abort, so the "
                   "launcher forwards it")
NODE = Knob[str | None]("MPICKPT_NODE", None, str, "a node name",
                        "this rank's node, for the local level (default: the ranks that share "
                        "memory); for tests that simulate nodes on one host, and odd launchers")
def _backend(raw: str) -> str:
    name = raw.strip().lower()
    if name not in ("auto", "mpi", "torch"):
        raise ValueError("must be auto, mpi or torch")
    return name


BACKEND = Knob("MPICKPT_BACKEND", "auto", _backend, "auto, mpi or torch",
               "what the protocol's collectives run over: auto takes MPI under an MPI launcher "
               "(or where mpi4py is initialised) and torch.distributed's gloo under torchrun "
               "(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set); a process that no launcher "
               "started runs alone, with no communication and MPI not started (mpi: start it "
               "anyway)")


def _count(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be a whole number, 0 or more")
    return value


CHECK_PIECES_RANKS = Knob("MPICKPT_CHECK_PIECES_RANKS", 64, _count, "a number of ranks",
                          "with index parts, rank 0 reads every part at the commit to check "
                          "that sharded tensors tile, up to this many ranks (above, a restore "
                          "checks the pieces it reads); 0 never")
RESTORE_GPU_ROOM = Knob("MPICKPT_RESTORE_GPU_ROOM", True, _flag, "0 or 1",
                        "0: a restore into a state on a GPU takes the bytes through host "
                        "memory, not GPU memory set aside while they come (read from ROOT, "
                        "over MPI, or from the node's own shards in memory; used where the GPU "
                        "has the bytes and 1 GiB free)")
XOR_LAND_BY_ROUNDS = Knob("MPICKPT_XOR_LAND_BY_ROUNDS", True, _flag, "0 or 1",
                          "0: an XOR save's snapshot on a GPU lands in host memory in address "
                          "order, not in the order its parity's rounds take it (protected "
                          "later: 1.53x the slowest bound against 1.12x on an H200, "
                          "docs/performance.md)")
FAULT = Knob("MPICKPT_FAULT", "", str, "phase:rank:action[:step],...",
             "fault injection for tests (mpickpt/faults.py); unset in production")

ALL: tuple[Knob, ...] = (TIMEOUT, TIMEOUT_GRACE, DEADLINE, REQUEUE, SIGNAL, LOG, EXIT_GRACE,
                         READY_FILE, ABORT_DELAY, NODE, BACKEND, CHECK_PIECES_RANKS,
                         RESTORE_GPU_ROOM, XOR_LAND_BY_ROUNDS, FAULT)


def markdown_table() -> str:
    """The variables as the Markdown table of docs/using.md."""
    rows = ["| variable | default | value | what |", "| --- | --- | --- | --- |"]
    for k in ALL:
        default = "unset" if k.default in (None, "") else str(k.default)
        if isinstance(k.default, bool):
            default = str(int(k.default))
        rows.append(f"| `{k.name}` | {default} | {k.kind} | {k.doc} |")
    return "\n".join(rows)
