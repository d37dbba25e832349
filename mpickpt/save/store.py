"""What a destination of the save pipeline does: the steps every store has.

The pipeline (:mod:`mpickpt.save.pipeline`) runs the same sequence for every save, whatever its
destination: ``write`` (this rank's shard into the store's partial directory), ``protect``
(redundancy, where the store has any), the vote that is also the assembly of the manifest (one
gather, :mod:`mpickpt.save.assemble`), ``publish`` (the commit, :mod:`mpickpt.format.commit`, or
the discard of what an aborted save wrote), then ``retain`` (what follows a commit). Two stores
do it: :class:`~mpickpt.save.rootstore.RootStore` (ROOT, a file per rank or per node) and
:class:`~mpickpt.local.nodestore.NodeStore` (the node-local level, with partner copies or XOR
parity). A drain is the same sequence from the node store into ROOT (its vote an allreduce).
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, Protocol

from .. import log
from ..errors import RankFailure
from ..format import rootdir
from ..format.entry import RankEntry
from ..format.manifest import Manifest
from .request import SaveRequest, SaveResult


class Published(NamedTuple):
    """What ``publish`` tells every rank: where the checkpoint committed (None: it did not),
    why not (and the failure of each rank that failed), and the user metadata it committed
    with."""

    path: str | None
    error: str | None
    metadata: dict[str, Any]
    failures: tuple[RankFailure, ...] = ()


class Store(Protocol):
    """A destination of the save pipeline. Every method runs on every rank; those that say
    "collective" must be called by all of them."""

    level: str  # SaveResult.level: "root" or "local"
    extended: bool  # whether its manifests are version 3 (see ShardOptions.extended)

    def partial(self, step: int) -> str:
        """The directory that step ``step`` is written into before its commit."""

    def final(self, step: int) -> str:
        """The directory of committed step ``step`` (on this rank's node, for the node
        store)."""

    def manifest(self, step: int) -> Manifest:
        """The manifest of committed step ``step``, as this rank reads it."""

    def write(self, req: SaveRequest, partial: str) -> tuple[RankEntry | None, str | None]:
        """This rank's shard, durable: its entry, or why not (``req.error`` passed on)."""

    def protect(self, req: SaveRequest, partial: str, entry: RankEntry | None,
                error: str | None) -> str | None:
        """Collective: make the written shards survive what the store is meant to survive;
        this rank's error, if any."""

    def publish(self, step: int, partial: str, manifest: Manifest | None, error: str | None,
                stats: dict[str, float], started: float = 0.0,
                failures: tuple[RankFailure, ...] = ()) -> Published:
        """Collective: commit ``partial`` with ``manifest`` (rank 0's; None elsewhere, and
        where ``error`` says why there is none), or discard it; the outcome, on every rank.
        ``started``: when the save was asked for (``perf_counter``); ``failures``: rank 0's
        record of the ranks whose vote failed (the save is discarded)."""

    def discard(self, partial: str) -> None:
        """After an abort: remove ``partial`` (the ranks that own it do)."""

    def retain(self, result: SaveResult, entry: RankEntry | None) -> None:
        """After a commit: record it and apply the store's retention."""


def discard(path: str, run_id: str, logger: logging.Logger) -> None:
    """Remove a partial (or half-published) directory; a failure is logged: the next start
    removes it."""
    try:
        if os.path.lexists(path):
            rootdir.remove(path, run_id)
    except OSError as e:
        logger.warning("could not remove %s (%s); it is removed at the next start", path,
                       log.os_error(e, path))
