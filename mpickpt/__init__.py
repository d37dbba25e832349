"""mpickpt: consistent global checkpoints for PyTorch jobs launched with MPI."""

from .checkpointer import Checkpointer, SaveHandle, SaveResult
from .errors import (
    CheckpointError,
    CollectiveTimeout,
    ManifestError,
    SaveAborted,
    ShardError,
    StateMismatchError,
    StateTreeError,
    WorldSizeMismatchError,
)
from .restore import RestoreInfo
from .sharding import Shard
from .state_tree import RNGState

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CollectiveTimeout",
    "ManifestError",
    "RNGState",
    "RestoreInfo",
    "SaveAborted",
    "SaveHandle",
    "SaveResult",
    "Shard",
    "ShardError",
    "StateMismatchError",
    "StateTreeError",
    "WorldSizeMismatchError",
    "__version__",
]
