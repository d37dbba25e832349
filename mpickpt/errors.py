"""Exceptions raised by mpickpt. Every message is a sentence an operator can act on."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error mpickpt raises."""


class StateTreeError(CheckpointError, TypeError):
    """The user's state holds something mpickpt cannot save; the message names the key path."""


class MetadataError(CheckpointError, TypeError):
    """``save(metadata=...)`` holds a value that is not JSON; the message names the key."""


class RootNotSharedError(CheckpointError):
    """ROOT is not one directory that every rank sees (node-local storage, different paths)."""


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
