"""The node store: checkpoints in each node's own directory, protected across nodes.

The same steps as ROOT's store, on the node-local level (:class:`~mpickpt.local.level.LocalLevel`):
``write`` checks that the node has room and writes the rank's shard flat (``rank-RRRRR.h5``,
through memory maps on a tmpfs); ``protect`` runs the redundancy exchange once every rank has
its shard (partner copies or XOR parity, :mod:`mpickpt.local.exchange`); ``publish`` sends rank 0's
manifest to every node, whose leader commits it there with ``LEVEL.json`` beside it
(:meth:`~mpickpt.local.nodedir.NodeDir.publish`), and the step is protected once every node did;
``retain`` keeps the newest ``Local(keep=)`` steps on each node. Its recovery
(:mod:`mpickpt.local.recovery`) runs these steps backwards: find the newest step every rank can
rebuild, rebuild what a lost node held from the survivors, read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from .. import faults, log
from ..errors import RankFailure
from ..format.entry import RankEntry
from ..format.manifest import Manifest
from ..format.names import shard_name
from ..format.shard import ShardWriter, byte_view
from ..mpi.protocol import Protocol
from ..save.landing import Landing
from ..save.request import SaveRequest, SaveResult
from ..save.shards import RankShards, error_text
from ..save.store import Published, discard
from . import parity
from .exchange import Streamed
from .level import LocalLevel
from .pool import Mapped

if TYPE_CHECKING:
    import torch


class NodeStore:
    """The node-local level, as one destination of the save pipeline (see
    :class:`~mpickpt.save.store.Store`)."""

    level = "local"
    extended = False  # flat, a shard per rank: every tool reads it like a version 2 one

    def __init__(self, proto: Protocol, run_id: str, level: LocalLevel, shards: RankShards,
                 logger: logging.Logger) -> None:
        self.proto, self.run_id, self.lv = proto, run_id, level
        self.rank, self.shards, self.log = proto.rank, shards, logger
        # partner streams of saves written, not yet protected: step -> (outcome, metadata)
        self._streams: dict[int, tuple[Streamed, list[tuple[int, bytes]]]] = {}

    def partial(self, step: int) -> str:
        return self.lv.nodedir.partial(step, self.run_id)

    def final(self, step: int) -> str:
        return self.lv.nodedir.final(step)

    def manifest(self, step: int) -> Manifest:
        """The manifest of committed step ``step`` on this node."""
        return Manifest.read(self.final(step))

    def write(self, req: SaveRequest, partial: str) -> tuple[RankEntry | None, str | None]:
        """The shard, into its recycled file kept mapped (or a new one); with redundancy its
        tensor bytes go out meanwhile, straight from the snapshot as they land in host memory:
        to the holder (partner, :meth:`Exchange.stream`; the copy of the rank held here comes
        in likewise), or around the team's ring into the parities (XOR,
        :meth:`Exchange.parity_stream`)."""
        lv, entry, error = self.lv, None, req.error
        stream: Future[Streamed] | None = None
        sealed: list[ShardWriter] = []

        def started(writer: ShardWriter, host: dict[str, torch.Tensor], landing: Landing | None
                    ) -> None:
            nonlocal stream
            sealed.append(writer)
            if lv.exchange is None:
                return
            take, hit = self._hooks(req, partial)
            tensors = [r for r in writer.records if r.codec is None and r.nbytes]
            if lv.scheme == "xor":  # by offset; without a template (compressed tensors): none
                runs = None if writer.size_hint is None else [
                    parity.Run(r.offset, np.frombuffer(byte_view(host[r.name]), dtype=np.uint8),
                               host[r.name].data_ptr())
                    for r in sorted(tensors, key=lambda r: r.offset)]
                stream = lv.exchange.parity_stream(runs, writer.size_hint or 0, take, hit,
                                                   landing)
            else:  # in the order the bytes land in host memory
                tensors.sort(key=lambda r: host[r.name].data_ptr())
                stream = lv.exchange.stream([(r.offset, byte_view(host[r.name])) for r in tensors],
                                            writer.data_end, take, hit, landing)

        try:
            if req.snapshot is not None and req.tree is not None:
                lv.check_save(req)
                into = lv.take(partial, shard_name(self.rank))
                entry = self.shards.write(req, partial, shard_name(self.rank), into=into,
                                          started=started)
        except Exception as e:
            error = error_text(e)
        if lv.exchange is not None:
            with self.proto.fatal_timeouts(self.log):
                if stream is None:  # nothing laid out: stream nothing, the team must not wait
                    take, hit = self._hooks(req, partial)
                    stream = (lv.exchange.parity_stream(None, 0, take, hit)
                              if lv.scheme == "xor" else lv.exchange.stream([], 0, take, hit))
                t = time.perf_counter()
                done = stream.result()
                req.stats.update(stream_s=done.seconds, stream_wait_s=time.perf_counter() - t)
                if lv.scheme == "xor":
                    req.stats["parity_from_snapshot"] = float(done.chunk > 0)
                self._streams[req.step] = (done, sealed[0].metadata if sealed and entry else [])
        return entry, error

    def _hooks(self, req: SaveRequest, partial: str
               ) -> tuple[Callable[[int], Mapped], Callable[[], None]]:
        """A stream's file for what this rank stores of ``rank`` (a partner copy, or its own
        parity), and its fault point."""
        lv = self.lv
        return (lambda rank: lv.take(partial, lv.names(rank)),
                lambda: faults.hit("mid-exchange", self.rank, req.step))

    def protect(self, req: SaveRequest, partial: str, entry: RankEntry | None,
                error: str | None) -> str | None:
        """Partner: the copies' HDF5 metadata, once every shard is sealed, and the copies made
        durable. XOR: once every rank has its shard, the team's HDF5 metadata into the parity
        (or, where it could not go from the snapshot, the whole parity from the files), made
        durable."""
        lv = self.lv
        if lv.exchange is None:
            return error
        t = time.perf_counter()
        try:
            if lv.scheme == "partner":
                streamed, metadata = self._streams.pop(req.step)
                moved = lv.exchange.seal(streamed, entry.bytes if entry else 0, metadata)
                if error is not None:
                    return error
            else:
                streamed, metadata = self._streams.pop(req.step)
                if not self.proto.all_ok(error is None, "local-write"):
                    return error or "the save aborted: another rank could not write its shard"
                assert entry is not None
                moved = lv.exchange.parity_seal(
                    streamed, f"{partial}/{entry.file}", entry.bytes, metadata,
                    lambda: faults.hit("mid-exchange", self.rank, req.step))
            faults.hit("after-exchange-before-vote", self.rank, req.step)
        except Exception as e:
            return error or f"the {lv.scheme} exchange failed: {error_text(e)}"
        req.stats.update(protect_s=time.perf_counter() - t, sent_bytes=moved.sent)
        return None

    def publish(self, step: int, partial: str, manifest: Manifest | None, error: str | None,
                stats: dict[str, float], started: float = 0.0,
                failures: tuple[RankFailure, ...] = ()) -> Published:
        """Every node's leader writes rank 0's manifest into its partial directory and renames
        it into place; the step is protected once every node did. After a failed vote
        (``failures``, rank 0's) every leader discards its partial directory."""
        lv, text = self.lv, None
        if manifest is not None:
            try:
                text = manifest.to_json()
            except Exception as e:
                error = f"rank 0: commit failed: {error_text(e)}"
        text, error, metadata, failures = self.proto.bcast(
            (text, error, manifest.metadata if manifest is not None else {}, failures), "commit")
        if failures:  # every rank learnt the vote's outcome from rank 0: nothing to agree on
            self.discard(partial)
            return Published(None, error, {}, failures)
        if error is None:
            try:
                faults.hit("mid-local-commit", self.rank, step)
                if lv.leader:
                    assert text is not None
                    lv.nodedir.publish(partial, step, text.encode(), lv.level_record())
            except Exception as e:
                error = f"rank {self.rank}: {error_text(e)}"
        elif lv.leader:
            self.discard(partial)
        if failed := self.proto.agree(error, "local-commit"):
            if lv.leader:
                self.discard(self.final(step))
                self.discard(partial)
            return Published(None, str(failed), {}, failed.records)
        stats["protected_s"] = time.perf_counter() - started
        return Published(self.final(step), None, metadata)

    def discard(self, partial: str) -> None:
        if self.lv.leader:
            discard(partial, self.run_id, self.log)

    def retain(self, result: SaveResult, entry: RankEntry | None) -> None:
        """Say so (rank 0) and keep the newest local steps (leaders)."""
        lv, s = self.lv, result.stats
        if self.rank == 0:
            self.log.info("checkpoint step %d protected on the nodes (%s) %.2f s after save(): "
                          "%s", result.step, lv.scheme or "no redundancy",
                          s.get("protected_s", 0.0), log.human_bytes(int(s.get("bytes", 0))))
        if lv.leader:
            try:
                lv.nodedir.retain(lv.keep, self.run_id, result.step)
            except OSError as e:
                self.log.warning("rank %d: could not remove an old local checkpoint: %s",
                                 self.rank, e)
