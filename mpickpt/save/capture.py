"""The training thread's part of a save, and its whole cost: from the user's state to a
:class:`~mpickpt.save.request.SaveRequest` the background pipeline takes over.

In order: the fault point ``before-snapshot``; the metadata checked (:mod:`mpickpt.save.metadata`);
the state flattened into a JSON tree and named tensors with their placements
(:mod:`mpickpt.format.state_tree`); the replicated pieces another rank writes dropped
(:func:`mpickpt.sharding.keep_mine`); the optimizers and modules fenced; the tensors snapshotted
into a host buffer (:mod:`mpickpt.save.snapshot`: those only an optimizer in the state changes are
copied while forward and backward run), unless every buffer is in flight and the Checkpointer
skips such saves (``if_busy="skip"``). A failure does not raise here: it travels in the
request, so that every rank aborts the save together; a mistake of the user's (a state or
metadata mpickpt cannot save) is also handed back to be raised once they have.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import faults
from ..errors import CheckpointError, MetadataError, StateTreeError
from ..format import state_tree
from ..sharding import keep_mine
from . import metadata as user_metadata
from .incremental import Tracker
from .pinned_pool import HostPool
from .request import SaveRequest, WaitLog
from .snapshot import Snapshotter

# a first save that page-locks this many bytes or more logs the prepare() hint
HINT_BYTES = 256 << 20


class Capture:
    """Takes a rank's state into a :class:`SaveRequest`, through ``pool``'s host buffers."""

    def __init__(self, pool: HostPool, device_staging: bool, replicated: tuple[str, ...],
                 rank: int, world_size: int, logger: logging.Logger, skip: bool = False,
                 share: int = 0) -> None:
        self.pool = pool
        self.skip = skip  # if_busy="skip": no snapshot while every buffer is in flight
        self.snapshotter = Snapshotter(pool, device_staging)
        self.snapshotter.warm()  # its copy stream and ring, if CUDA is in use already
        self.replicated, self.rank, self.world_size = replicated, rank, world_size
        self.share = share  # Files(min_write_share=): see sharding.writers
        self._waits = WaitLog(logger, pool.slots) if rank == 0 else None
        self.log = logger
        self._hinted = False  # the prepare() hint is given once
        self.tracker: Tracker | None = None  # incremental: frozen tensors are not snapshotted

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate now the buffers a snapshot of ``state`` will need."""
        self.snapshotter.prepare(self._flatten(state, [])[1])

    def _flatten(self, state: dict[str, Any], owners: list[Any]
                 ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(tree, the tensors this rank writes, placements) of ``state``; its optimizers and
        modules appended to ``owners``."""
        tree, tensors, placements = state_tree.flatten_placed(
            state, self.replicated, self.world_size, owners=owners)
        keep_mine(tensors, placements, self.rank, self.share)
        return tree, tensors, placements

    def _hint(self, nbytes: int) -> None:
        """Rank 0, once: a save that page-locked a large buffer (no room on the GPU to stage
        the snapshot, so it is copied straight into host memory) stalled training for seconds
        (the CUDA driver is held); prepare() does it before the loop."""
        if self._hinted or self.rank != 0 or nbytes < HINT_BYTES:
            return
        self._hinted = True
        self.log.warning(
            "this save page-locked %.1f GB of host memory for its snapshot (the GPU has no room "
            "to stage it): the CUDA driver was held meanwhile and training steps waited for it "
            "(about 0.6 s per GB); call Checkpointer.prepare(state) before the training loop to "
            "do it there", nbytes / 1e9)

    def take(self, step: int, state: dict[str, Any], metadata: dict[str, Any] | None
             ) -> tuple[SaveRequest, CheckpointError | None]:
        """(the request, the user's mistake to raise once every rank aborted the save)."""
        t0 = time.perf_counter()
        request = SaveRequest(step, None, None, {}, {}, {})
        user_error: CheckpointError | None = None
        try:
            faults.hit("before-snapshot", self.rank, step)
            request.metadata = user_metadata.check(metadata)
            found: list[Any] = []
            request.tree, tensors, request.placements = self._flatten(state, found)
            if self.tracker is not None:
                request.elided = self.tracker.elide(tensors, request.placements)
                for name in request.elided:
                    del tensors[name]
            maps = self.snapshotter.guard(found)
            waits = self.pool.in_flight() >= self.pool.slots
            if waits and self.skip:  # every rank skips it: see Pipeline._skipped
                request.busy = True
                request.stats["stall_s"] = time.perf_counter() - t0
                return request, None
            locked = self.pool.locked_bytes
            request.snapshot = self.snapshotter.take(tensors, maps)
            if self.pool.locked_bytes > locked:
                self._hint(request.snapshot.nbytes)
            if self._waits is not None:
                self._waits.saw(step, waits, self.pool.waited_s)
        except (StateTreeError, MetadataError) as e:
            request.error, user_error = str(e), e
        except Exception as e:
            request.error = f"{type(e).__name__}: {e}"
        request.stats["stall_s"] = time.perf_counter() - t0
        if request.snapshot is not None:
            request.stats["snapshot_bytes"] = request.snapshot.nbytes
            request.stats["waited_for_buffer_s"] = self.pool.waited_s
        return request, user_error
