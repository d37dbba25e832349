"""Options that belong together, given to :class:`~mpickpt.Checkpointer` as one object that
checks its own combinations.

``Checkpointer(root, local=Local("/dev/shm/run", redundancy="partner", persist_every=10))``.
A bare path (``local="/dev/shm/run"``) is ``Local(path)``, with every default. The flat
keywords of earlier releases (``redundancy=``, ``persist_every=``, ``keep_local=``,
``local_budget=``, ``xor_set=``, ``drain_bandwidth=``) still work, with a
:class:`DeprecationWarning` that shows the ``Local(...)`` to write instead.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from typing import Any

from .topology import SCHEMES


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a flat keyword the caller did not give

# the flat keywords of Checkpointer, and the field of Local each one became
LOCAL_KEYWORDS = {"redundancy": "redundancy", "persist_every": "persist_every",
                  "keep_local": "keep", "local_budget": "budget", "xor_set": "xor_set",
                  "drain_bandwidth": "drain_bandwidth"}


@dataclass(frozen=True)
class Local:
    """The node-local level: every save is committed in ``path`` on each node first (memory,
    ``/dev/shm/...``, or an NVMe scratch directory) and protected from the loss of a node by
    ``redundancy``: ``"partner"`` (a copy of each shard on another node), ``"xor"`` (parity over
    sets of ``xor_set`` nodes, default 4) or None (a restart of the job, not the loss of a node).
    Every ``persist_every``-th save (None: none besides the emergency one and the last) is then
    drained to ROOT, at most ``drain_bandwidth`` bytes per second per rank. ``keep`` protected
    checkpoints stay on the nodes besides the one being written, within ``budget`` bytes per
    node."""

    path: str | os.PathLike[str]
    redundancy: str | None = None
    persist_every: int | None = 10
    keep: int = 1
    budget: int | None = None
    xor_set: int | None = None
    drain_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"Local(path) must be a directory path, not {self.path!r}")
        if self.redundancy not in (None, *SCHEMES):
            raise ValueError(f"Local(redundancy=) must be 'partner', 'xor' or None, not "
                             f"{self.redundancy!r}")
        if self.persist_every is not None and not _positive_int(self.persist_every):
            raise ValueError(f"Local(persist_every=) must be a positive int or None, not "
                             f"{self.persist_every!r}")
        if not _positive_int(self.keep):
            raise ValueError(f"Local(keep=) must be 1 or more, not {self.keep!r}")
        if self.budget is not None and not _positive_int(self.budget):
            raise ValueError(f"Local(budget=) must be a positive number of bytes or None, not "
                             f"{self.budget!r}")
        if self.xor_set is not None:
            if self.redundancy != "xor":
                raise ValueError(f"Local(xor_set={self.xor_set!r}) sizes the parity sets of "
                                 f"redundancy='xor', not of redundancy={self.redundancy!r}")
            if not _positive_int(self.xor_set) or self.xor_set < 2:
                raise ValueError(f"Local(xor_set=) must be 2 nodes or more, not "
                                 f"{self.xor_set!r}")
        if self.drain_bandwidth is not None and not (
                isinstance(self.drain_bandwidth, (int, float)) and self.drain_bandwidth > 0):
            raise ValueError(f"Local(drain_bandwidth=) must be bytes per second > 0 or None, "
                             f"not {self.drain_bandwidth!r}")

    def __repr__(self) -> str:
        given = [repr(os.fspath(self.path))] + [
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[1:]
            if getattr(self, f.name) != f.default]
        return f"Local({', '.join(given)})"


def local_of(local: str | os.PathLike[str] | Local | None, flat: dict[str, Any],
             stacklevel: int = 3) -> Local | None:
    """The node-local level's settings from Checkpointer's ``local=`` and its deprecated flat
    keywords (``flat``: keyword -> value, :data:`UNSET` where not given)."""
    given = {k: v for k, v in flat.items() if v is not UNSET}
    if local is None:
        if given.get("redundancy") is not None:
            raise ValueError("redundancy protects the node-local level: give local= too")
        return None
    if isinstance(local, Local):
        if given:
            raise ValueError(f"give the node-local level's settings in Local(...) only, not "
                             f"also as Checkpointer keywords ({', '.join(given)})")
        return local
    level = Local(local, **{LOCAL_KEYWORDS[k]: v for k, v in given.items()})
    if given:
        warnings.warn(
            f"Checkpointer({', '.join(f'{k}=' for k in given)}...) is deprecated: write "
            f"Checkpointer(..., local=mpickpt.{level!r}); the flat keywords go in a later "
            "release", DeprecationWarning, stacklevel=stacklevel)
    return level


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
