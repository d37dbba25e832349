"""What follows a commit, on rank 0: the log line, the figures in ROOT/stats.jsonl, retention
(whose retired shard files wait in ``ROOT/.pool`` for the next save to write over, when saves
write them whole: :func:`mpickpt.format.rootdir.retire`).

The checkpoint is committed on every rank before any of this runs, so a failure here (a full
disk, no write permission) is logged and undoes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from .. import faults, log
from ..errors import ManifestError
from ..format import names, rootdir
from ..format.manifest import Manifest
from . import retention

STATS = "stats.jsonl"
# ROOT/stats.jsonl grows by a line (about 400 bytes) per commit; at this size it becomes
# stats.jsonl.1, replacing the older one, so that the two never hold much more than twice this
STATS_MAX_BYTES = 16 << 20


class Upkeep:
    """Rank 0's work after each commit under ``root``, by ``policy``."""

    def __init__(self, root: str, run_id: str, policy: retention.Policy,
                 logger: logging.Logger, recycle: bool = False) -> None:
        self.root, self.run_id, self.policy, self.log = root, run_id, policy, logger
        # recycle: a retired checkpoint's shard files go to the pool, for the next save to
        # write over (rootdir.retire), instead of being deleted
        self.pool = os.path.join(root, rootdir.POOL) if recycle else None
        # of committed steps, read once each: user metadata, steps referred to (incremental)
        self._metadata: dict[int, dict[str, Any]] = {}
        self._references: dict[int, list[int]] = {}

    def committed(self, manifest: Manifest) -> None:
        """The manifest rank 0 just committed: its user metadata and references, known without
        reading it back."""
        self._metadata[manifest.step] = manifest.metadata
        self._references[manifest.step] = list(manifest.references)

    def after_commit(self, step: int, path: str | None, stats: dict[str, float],
                     metadata: dict[str, Any]) -> None:
        self.log.info("checkpoint step %d committed: %s, stall %.3f s, persist %s (rank 0), "
                      "commit %.0f ms -> %s", step, log.human_bytes(stats.get("bytes", 0)),
                      stats["stall_s"], log.human_rate(stats.get("persist_GBps", 0) * 1e9),
                      stats.get("commit_s", 0) * 1e3, path)
        self.record(step, stats)
        faults.hit("after-commit-before-retention", 0, step)
        self._metadata[step] = metadata
        self.retain(step)

    def record(self, step: int, stats: dict[str, float]) -> None:
        """Append the figures of a commit to stats.jsonl (never through a link)."""
        where = os.path.join(self.root, STATS)
        try:
            _rotate(where)
            line = (json.dumps({"step": step, "time": time.time(), **stats}) + "\n").encode()
            # one write(2) of the line, appended whole (no file object: a third of the cost)
            fd = os.open(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         rootdir.FILE_MODE)
            try:
                view = memoryview(line)
                while view:  # (a regular file's write is short only when the disk fills)
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as e:
            self.log.warning("could not append step %d's figures to %s: %s", step, where,
                             log.os_error(e, where))

    def retain(self, newest: int) -> None:
        """Remove the committed checkpoints no rule of the policy keeps (never ``newest``)."""
        if not self.policy.deletes:
            return
        committed = dict(rootdir.committed(self.root))
        doomed, _ = retention.plan(self.policy, [
            (step, self._metadata_of(step, path) if self.policy.best else {})
            for step, path in committed.items()],
            {step: self.references_of(step, path) for step, path in committed.items()})
        for step in doomed:
            if step == newest:
                continue
            self.log.info("retention (%s): removing step %d", self.policy.describe(), step)
            self._metadata.pop(step, None)
            self._references.pop(step, None)
            try:
                if self.pool is None:
                    rootdir.remove(committed[step], self.run_id)
                else:
                    rootdir.retire(committed[step], self.run_id, self.pool, _rank_shard)
            except OSError as e:
                self.log.warning("retention could not remove %s: %s; what is left of it is "
                                 "removed at a later start", committed[step],
                                 log.os_error(e, committed[step]))
            faults.hit("mid-retention", 0, newest)

    def referrers(self, step: int) -> list[int]:
        """The committed steps whose records refer to ``step``'s shards."""
        return sorted(s for s, path in rootdir.committed(self.root)
                      if step in self.references_of(s, path))

    def _read(self, step: int, path: str) -> None:
        """Read a committed step's manifest once: its user metadata and references. An
        unreadable one is unranked and refers to nothing (it cannot be loaded anyway)."""
        try:
            m = Manifest.read(path)
            self._metadata[step], self._references[step] = m.metadata, m.references
        except ManifestError as e:
            if self.policy.best:
                self.log.warning("retention cannot rank step %d by %s: %s", step,
                                 self.policy.best, e)
            self._metadata[step], self._references[step] = {}, []

    def _metadata_of(self, step: int, path: str) -> dict[str, Any]:
        """The user metadata of a committed step (read from its manifest once)."""
        if step not in self._metadata:
            self._read(step, path)
        return self._metadata[step]

    def references_of(self, step: int, path: str) -> list[int]:
        """The older steps a committed step refers to (read from its manifest once)."""
        if step not in self._references:
            self._read(step, path)
        return self._references[step]


def _rank_shard(rel: str) -> bool:
    """Whether ``rel`` (relative to a checkpoint) is a rank's shard, which a save writes over."""
    m = names.SHARD_RE.match(rel)
    return m is not None and m.group(1) == "rank"


def _rotate(stats: str) -> None:
    """Bound ROOT/stats.jsonl: at STATS_MAX_BYTES it becomes ``stats.jsonl.1``."""
    try:
        size = os.lstat(stats).st_size
    except FileNotFoundError:
        return
    if size >= STATS_MAX_BYTES:
        os.replace(stats, stats + ".1")
