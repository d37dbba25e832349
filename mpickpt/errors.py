"""Exceptions raised by mpickpt. Every message is a sentence an operator can act on."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

_AGREED = "_mpickpt_same_on_every_rank"
# how long a rank other than 0 waits, after its one line, so that rank 0 prints the error in full
# before a launcher ends the job for the first rank that exited
OTHERS_WAIT_S = 3.0


class CheckpointError(Exception):
    """Base class of every error mpickpt raises."""


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure in one phase of the protocol (``"vote"``, ``"local-commit"``,
    ``"commit"``, ``"drain"`` ...), as every rank learns it: what a failed save's
    :attr:`SaveResult.failures` lists, and what its error says, one per failed rank."""

    rank: int
    phase: str
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.reason}"


class StateTreeError(CheckpointError, TypeError):
    """The user's state holds something mpickpt cannot save; the message names the key path."""


class MetadataError(CheckpointError, TypeError):
    """``save(metadata=...)`` holds a value that is not JSON; the message names the key."""


class RootNotSharedError(CheckpointError):
    """ROOT is not one directory that every rank sees (node-local storage, different paths)."""


class RootInUseError(CheckpointError):
    """Another job is saving into this ROOT now (see :mod:`mpickpt.format.rootlock`)."""


class LocalTierFull(CheckpointError):
    """The node-local level cannot hold a checkpoint within its budget or its free space."""


class StateMismatchError(CheckpointError):
    """A checkpoint does not fit the state it is restored into (a missing key, shape or dtype)."""


class ManifestError(CheckpointError):
    """A MANIFEST.json is missing, unreadable, of another version, or describes impossible data."""


class ShardError(CheckpointError):
    """A rank's shard file failed verification: size, checksum, or a record that does not fit it."""

    def __init__(self, rank: int, path: str, reason: str, tensor: str | None = None) -> None:
        self.rank, self.path, self.reason, self.tensor = rank, path, reason, tensor
        where = f" tensor {tensor!r}:" if tensor else ""
        super().__init__(f"rank {rank}: {path}:{where} {reason}")


class SaveAborted(CheckpointError):
    """A save was aborted on every rank; the previous checkpoints are untouched."""


class WorldSizeMismatchError(CheckpointError):
    """The checkpoint was written by a different number of ranks than are restoring it."""


class CollectiveTimeout(CheckpointError):
    """A collective of the checkpoint protocol did not complete before its deadline."""


class FaultInjected(CheckpointError):
    """Raised by a fault injection point (MPICKPT_FAULT) with action 'raise'."""


def mark_agreed(e: BaseException) -> None:
    """Mark ``e`` as raised alike on every rank (a configuration that cannot work, a collective
    refusal): printed in full by rank 0 only (:func:`short_form`)."""
    setattr(e, _AGREED, True)


def short_form(e: BaseException, rank: int | None) -> str | None:
    """On a rank other than 0, the one line that stands for an error raised alike on every rank
    (rank 0 prints it in full); None when ``e`` is to be printed in full here."""
    if not getattr(e, _AGREED, False) or not rank:
        return None
    return (f"[rank {rank}] {type(e).__name__} (raised alike on every rank; rank 0 prints it "
            "in full)\n")


def install_hook(rank: Callable[[], int | None]) -> None:
    """Let Python's handler of uncaught exceptions print an error raised alike on every rank
    once, on rank 0 (every other rank prints its one line); other exceptions as before."""
    previous = sys.excepthook
    if getattr(previous, "_mpickpt", False):
        return

    def hook(kind: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        line = short_form(e, rank())
        if line is None:
            previous(kind, e, tb)
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
            time.sleep(OTHERS_WAIT_S)  # the launcher may end the job when one rank exits

    hook._mpickpt = True  # type: ignore[attr-defined]
    sys.excepthook = hook
