"""The ROOT store: checkpoints in the shared directory every rank writes to.

``write``: a shard per rank (``shards-NNNN/rank-RRRRR.h5`` past ``fanout`` ranks), written over
the file of that name that retention retired last where ``ROOT/.pool`` has one, or this
rank's regions of its node's file (``Files(per="node")``, collective over the node), and with
``split_index`` an index part per rank. ``protect``: nothing (the shared file system is the
redundancy). ``copy_in``: a drain's copy of the node's shard, over a recycled file too.
``publish``: rank 0 checks that every shard is where it sees it, at its size, and commits
(:func:`mpickpt.format.commit.publish`); a step committed before is replaced, unless
incremental checkpoints refer to its files. ``retain``: rank 0's
:class:`~mpickpt.save.upkeep.Upkeep` (the log line, the figures, retention); the incremental
tracker learns the committed entry.
"""

from __future__ import annotations

import logging
import os
import time

from .. import faults
from ..errors import CheckpointError, RankFailure
from ..format import commit, nodefile, rootdir
from ..format.entry import RankEntry
from ..format.manifest import Manifest
from ..format.names import shard_name
from ..format.nodefile import NodeFiles
from ..mpi.protocol import Protocol, ranks_text
from . import shared_root
from .incremental import Tracker
from .request import SaveRequest, SaveResult
from .shards import RankShards, error_text
from .store import Published, discard
from .upkeep import Upkeep


class RootStore:
    """ROOT, as one destination of the save pipeline (see :class:`~mpickpt.save.store.Store`)."""

    level = "root"

    def __init__(self, proto: Protocol, root: str, run_id: str, shards: RankShards,
                 upkeep: Upkeep, logger: logging.Logger, node: NodeFiles | None = None) -> None:
        self.proto, self.root, self.run_id = proto, root, run_id
        self.rank, self.shards, self.upkeep, self.log = proto.rank, shards, upkeep, logger
        self.node = node  # files="per-node": this rank's node
        self.pool = upkeep.pool  # where retired shard files wait to be written over
        self.extended = shards.options.extended(proto.size)
        self.tracker: Tracker | None = shards.tracker
        self._claimed = False  # rank 0: ROOT's writer lock taken for drains

    def partial(self, step: int) -> str:
        return os.path.join(self.root, rootdir.partial_name(step, self.run_id))

    def final(self, step: int) -> str:
        return os.path.join(self.root, rootdir.step_name(step))

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.final(step))

    def write(self, req: SaveRequest, partial: str) -> tuple[RankEntry | None, str | None]:
        entry, error = None, req.error
        split = self.shards.options.split_index
        try:
            if self.node is not None:
                entry, error = self.shards.write_node(self.node, self.proto, req, partial, error)
                if split:
                    with self.proto.fatal_timeouts(self.log):
                        ref = nodefile.write_index(self.node, partial, entry, error)
                    if entry is not None:
                        entry.index = ref
            elif req.snapshot is not None and req.tree is not None:
                o = self.shards.options
                entry = None if split else self.shards.fileless(req)
                if entry is None:
                    name = shard_name(self.rank, self.proto.size, o.fanout)
                    entry = self.shards.write(req, partial, name, pool=self.pool)
                if split:
                    self.shards.write_index(partial, entry)
        except Exception as e:
            entry, error = None, error_text(e)
        return entry, error

    def protect(self, req: SaveRequest, partial: str, entry: RankEntry | None,
                error: str | None) -> str | None:
        return error

    def copy_in(self, source: str, partial: str, step: int, stats: dict[str, float],
                bandwidth: float | None) -> str | None:
        """A drain's write: this rank's shard, copied from ``source`` (a committed node-local
        checkpoint) into ``partial`` and fsynced, at most ``bandwidth`` bytes per second; why
        it could not be."""
        try:
            if self.rank == 0 and not self._claimed:  # a ROOT unusable at the start: not yet
                busy, _ = shared_root.claim(self.proto, self.root, self.log)
                if busy is not None:
                    return f"rank 0: {busy}"
                self._claimed = True
            rootdir.make_dirs(partial)
            name = shard_name(self.rank)
            dst = os.path.join(partial, name)
            over = self.pool is not None and rootdir.take(self.pool, name, dst)
            stats["drained_bytes"] = rootdir.copy_file(
                os.path.join(source, name), dst,
                on_bytes=lambda _: faults.hit("mid-drain", self.rank, step),
                bandwidth=bandwidth, over=over)
        except Exception as e:
            return f"rank {self.rank}: {error_text(e)}"
        return None

    def publish(self, step: int, partial: str, manifest: Manifest | None, error: str | None,
                stats: dict[str, float], started: float = 0.0,
                failures: tuple[RankFailure, ...] = (), phase: str = "commit") -> Published:
        """Rank 0 commits (or discards, after a failed vote), every rank learns the outcome (one
        broadcast; the other ranks wait for it dozing while nobody waits for them: see
        :class:`~mpickpt.mpi.polling.Waker`)."""
        outcome = Published(None, error, {}, failures)
        if self.rank == 0:
            if error is None:
                assert manifest is not None
                t = time.perf_counter()
                try:
                    check_shards(partial, manifest.ranks)
                    outcome = Published(self._commit(partial, manifest, stats), None,
                                        manifest.metadata)
                except Exception as e:
                    outcome = Published(None, f"rank 0: commit failed: {error_text(e)}", {})
                stats["commit_s"] = stats.get("commit_s", 0.0) + time.perf_counter() - t
            if outcome.error is not None:
                self.discard(partial)
                if not outcome.failures:
                    outcome = outcome._replace(failures=(
                        RankFailure(0, phase, outcome.error.removeprefix("rank 0: ")),))
        return Published(*self.proto.bcast(tuple(outcome), phase, flat=True, idle=True))

    def discard(self, partial: str) -> None:
        if self.rank == 0:
            discard(partial, self.run_id, self.log)

    def retain(self, result: SaveResult, entry: RankEntry | None) -> None:
        if self.tracker is not None and entry is not None:
            self.tracker.committed(result.step, entry)
        try:
            if self.rank == 0:
                self.upkeep.after_commit(result.step, result.path, result.stats,
                                         result.metadata)
            else:
                faults.hit("after-commit-before-retention", self.rank, result.step)
        except Exception as e:  # the checkpoint is committed on every rank all the same
            self.log.error("checkpoint step %d is committed, but what follows the commit "
                           "failed on rank %d: %s", result.step, self.rank, error_text(e))

    def _commit(self, partial: str, manifest: Manifest, stats: dict[str, float]) -> str:
        """Publish: manifest into the partial directory, then the directory into place."""
        text = manifest.to_json().encode()
        stats["manifest_bytes"] = len(text)
        step = manifest.step
        path = commit.publish(self.root, partial, step, text,
                              existing=lambda final: self._replace(step, final),
                              on_half=lambda: faults.hit("mid-manifest-write", 0, step))
        self.upkeep.committed(manifest)
        return path

    def _replace(self, step: int, final: str) -> None:
        """The same step saved again (a rerun after a restore): replace it, unless incremental
        checkpoints refer to its files."""
        users = self.upkeep.referrers(step)
        if users:
            raise CheckpointError(
                f"step {step} is already committed and the incremental "
                f"checkpoint(s) of step {', '.join(map(str, users))} refer to its files: "
                "saving it again would break them. Roll back past them first "
                "(mpickpt-restore ROOT --step N)")
        self.log.warning(
            "step %d was already committed; this save replaces it. The number saved is the "
            "count of training steps done: a loop that resumes at the restored number and "
            "saves after training a step should save step + 1", step)
        rootdir.remove(final, self.run_id)


def check_shards(partial: str, ranks: list[RankEntry]) -> None:
    """Before the commit, on rank 0: every rank's shard is in the partial directory as rank 0
    sees it, of the size its rank wrote (a ROOT that is not shared leaves them elsewhere)."""
    found = commit.presence(partial, ranks)
    if found.missing:
        raise CheckpointError(f"the shards of {ranks_text(found.missing)} are not in {partial} "
                              "as rank 0 sees it, although they were written: "
                              f"{rootdir.NOT_SHARED_ADVICE}")
    if found.wrong_size:
        raise CheckpointError(f"the shards of {ranks_text(found.wrong_size)} in {partial} are "
                              "not of the size their ranks wrote")
