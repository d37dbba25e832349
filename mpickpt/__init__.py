"""mpickpt: consistent global checkpoints for PyTorch jobs launched with MPI.

The names below are imported on first use (PEP 562), so that ``import mpickpt`` and the operator's
tools (``mpickpt ls``, ``mpickpt-restore``) start without importing torch or initialising MPI;
``mpickpt.Checkpointer`` and ``from mpickpt import Checkpointer`` import them then.

Importing it (in the main thread) holds the preemption signal (SIGUSR2, or ``$MPICKPT_SIGNAL``):
one that arrives before the Checkpointer exists is kept for its first ``should_exit`` instead of
killing the rank.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import preempt
from .errors import (
    CheckpointError,
    CollectiveTimeout,
    LocalTierFull,
    ManifestError,
    MetadataError,
    RankFailure,
    RootInUseError,
    RootNotSharedError,
    SaveAborted,
    ShardError,
    StateMismatchError,
    StateTreeError,
    WorldSizeMismatchError,
)

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, SaveHandle, SaveResult
    from .ddp import prime_ddp
    from .mpi.backend import backend
    from .options import Encoding, Files, Local, Preemption, Retention, Snapshots
    from .restore.restorer import RestoreInfo
    from .save.incremental import frozen_params
    from .sharding import Piece, Shard
    from .stateful import RNGState, Values

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CollectiveTimeout",
    "Encoding",
    "Files",
    "Local",
    "LocalTierFull",
    "ManifestError",
    "MetadataError",
    "Piece",
    "Preemption",
    "RNGState",
    "RankFailure",
    "RestoreInfo",
    "Retention",
    "RootInUseError",
    "RootNotSharedError",
    "SaveAborted",
    "SaveHandle",
    "SaveResult",
    "Shard",
    "ShardError",
    "Snapshots",
    "StateMismatchError",
    "StateTreeError",
    "Values",
    "WorldSizeMismatchError",
    "__version__",
    "backend",
    "frozen_params",
    "prime_ddp",
]

# name -> the submodule that defines it, imported on first access
_LAZY = {
    "Checkpointer": "checkpointer", "SaveHandle": "checkpointer", "SaveResult": "checkpointer",
    "RestoreInfo": "restore.restorer", "Piece": "sharding", "Shard": "sharding",
    "RNGState": "stateful", "Values": "stateful", "frozen_params": "save.incremental",
    "prime_ddp": "ddp", "Local": "options", "Files": "options", "Retention": "options",
    "Encoding": "options", "Snapshots": "options", "Preemption": "options",
    "backend": "mpi.backend",
}

preempt.hold_early()


def __getattr__(name: str) -> Any:
    """The lazy names, and the submodules (``mpickpt.format.state_tree`` after ``import mpickpt``,
    as when this module imported them all)."""
    module = _LAZY.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later accesses do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
