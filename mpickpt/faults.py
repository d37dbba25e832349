"""Fault injection for tests: ``MPICKPT_FAULT="phase:rank:action[:step],..."``.

Phases: before-snapshot, mid-write, after-fsync-before-vote, after-vote-before-manifest,
mid-manifest-write, after-commit-before-retention, mid-restore-read; with a node-local level
also mid-exchange, after-exchange-before-vote, mid-local-commit, mid-drain, mid-drain-commit;
mid-retention fires on rank 0 after each checkpoint retention removes.
Rank ``*`` means every rank; step, when given, limits the fault to the save or restore of that
step. after-vote-before-manifest, mid-manifest-write, after-commit-before-retention and
mid-drain-commit fire on rank 0 around its manifest, commit and retention; on the other ranks
at the matching points: after the vote (before they send their entries to rank 0), while they
wait for rank 0's outcome, and once they have it. Actions: ``kill`` (SIGKILL self), ``raise``
(:class:`~mpickpt.errors.FaultInjected`), ``hang`` (sleep forever), ``exit``
(``os._exit(17)``), ``delay`` (sleep one second, then go on). Unset, :func:`hit` is one
dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

from . import knobs
from .errors import FaultInjected

PHASES = (
    "before-snapshot", "mid-write", "after-fsync-before-vote", "after-vote-before-manifest",
    "mid-manifest-write", "after-commit-before-retention", "mid-restore-read",
)
# the phases of the node-local level (Checkpointer(local=...)): the redundancy exchange, the
# commit on the nodes, the copy of a drain to ROOT and its commit there (rank 0; the others
# while they wait for its outcome)
LEVEL_PHASES = ("mid-exchange", "after-exchange-before-vote", "mid-local-commit", "mid-drain",
                "mid-drain-commit")
# rank 0, after each checkpoint retention removes (incremental checkpoints: a kill there must
# leave every kept checkpoint loadable)
RETENTION_PHASES = ("mid-retention",)
# the node-local level's recovery: each window of a shard copied from its partner (the donor
# and the receiver); the copy out of a slot of the restore's ring into place (the "step" is
# the ring group's number: local/ring.py)
RECOVERY_PHASES = ("mid-rebuild", "mid-ring-copy")
ALL_PHASES = PHASES + LEVEL_PHASES + RETENTION_PHASES + RECOVERY_PHASES
ACTIONS = ("kill", "raise", "hang", "exit", "delay")
EXIT_CODE = 17


def _parse(spec: str) -> dict[str, list[tuple[str, str, int | None]]]:
    out: dict[str, list[tuple[str, str, int | None]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        known = parts[0] in ALL_PHASES
        if len(parts) not in (3, 4) or not known or parts[2] not in ACTIONS:
            raise ValueError(
                f"MPICKPT_FAULT item {item!r} is not phase:rank:action[:step] with phase in "
                f"{ALL_PHASES} and action in {ACTIONS}"
            )
        step = int(parts[3]) if len(parts) == 4 else None
        out.setdefault(parts[0], []).append((parts[1], parts[2], step))
    return out


_FAULTS = _parse(knobs.FAULT.get())


def configure(spec: str) -> None:
    """Replace the faults in force (read from MPICKPT_FAULT at import) by ``spec``."""
    global _FAULTS
    _FAULTS = _parse(spec)


def hit(phase: str, rank: int, step: int | None = None) -> None:
    """Carry out the fault configured for this phase, rank and step, if any."""
    if not _FAULTS:
        return
    for who, action, at in _FAULTS.get(phase, ()):
        if who not in ("*", str(rank)) or (at is not None and at != step):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            raise FaultInjected(f"injected fault at {phase} on rank {rank}")
        elif action == "hang":
            while True:
                time.sleep(3600)
        elif action == "exit":
            os._exit(EXIT_CODE)
        elif action == "delay":
            time.sleep(1.0)
