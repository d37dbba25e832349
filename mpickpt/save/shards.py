"""Stage 1 of a save on one rank: its shard written and fsynced, and its entry for the manifest.

:class:`RankShards` holds what every store's write shares: the snapshot's tensors once copied
(less those an incremental save refers to), the shard's attributes, the write through
:class:`~mpickpt.format.shard.ShardWriter` (one file per rank) or :mod:`mpickpt.format.nodefile`
(this rank's regions of its node's file), and the :class:`~mpickpt.format.entry.RankEntry` that
describes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import faults
from ..format import checksum, nodefile, rootdir
from ..format.checksum import DEFAULT_BLOCK
from ..format.codec import MIN_BYTES as MIN_COMPRESS
from ..format.entry import IndexRef, RankEntry
from ..format.h5template import Templates
from ..format.manifest import tree_key
from ..format.names import FANOUT, index_name
from ..format.records import TensorRecord
from ..format.shard import DEFAULT_ALIGNMENT, ShardWriter
from .incremental import Decision, Tracker
from .landing import Landing
from .request import SaveRequest

if TYPE_CHECKING:
    import torch

    from ..format.nodefile import NodeFiles
    from ..format.shard import Destination
    from ..mpi.protocol import Protocol


@dataclass(frozen=True)
class ShardOptions:
    """How a rank's shard is written."""

    alignment: int = DEFAULT_ALIGNMENT  # tensors of this size and more start on this boundary
    block: int = DEFAULT_BLOCK  # bytes per checksum
    io_threads: int = 8
    split_index: bool = False  # each rank's records in an index part of its own (version 2)
    incremental: int | None = None  # refer to unchanged tensors; a full checkpoint every N saves
    frozen: Callable[[str], bool] | None = None  # tensor names referred to without hashing
    compression: Callable[[str], str | None] | None = None  # tensor name -> codec, or None
    per_node: bool = False  # one file per node (mpickpt.format.nodefile)
    fanout: int = FANOUT  # shards (and index parts) per directory, at most

    def extended(self, world_size: int) -> bool:
        """Whether manifests of ``world_size`` ranks are version 3 (incremental or compressed
        records, node files, sub-directories); 0 for the node-local level's (flat, per rank)."""
        return bool(self.incremental or self.compression or self.per_node
                    or world_size > self.fanout)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class RankShards:
    """Writes this rank's shard of each save, by ``options``; ``tracker`` decides what an
    incremental save refers to instead of writing."""

    def __init__(self, rank: int, world_size: int, options: ShardOptions,
                 tracker: Tracker | None, logger: logging.Logger) -> None:
        self.rank, self.world_size = rank, world_size
        self.options, self.tracker, self.log = options, tracker, logger
        self.templates = Templates()  # the HDF5 metadata of the layouts saved lately
        self._tree: tuple[bytes, str] | None = None  # the last tree written: tree_key, JSON

    def write(self, req: SaveRequest, partial: str, name: str,
              into: Destination | None = None,
              started: Callable[[ShardWriter, dict[str, torch.Tensor], Landing | None], None]
              | None = None,
              pool: str | None = None) -> RankEntry:
        """This rank's shard ``name`` in ``partial``, written and fsynced (``into``: a file of
        the node-local level, already in place and mapped; ``pool``: where a retired file of
        that name may wait to be written over, :func:`~mpickpt.format.rootdir.take`).
        ``started(writer, tensors, landing)`` is called once the layout fixes where each
        tensor's bytes go, before they are written; ``landing`` (else None) says how far the
        tensors' bytes have landed in host memory while they still do (:class:`Landing`)."""
        assert req.snapshot is not None and req.tree is not None
        o, stats, t0 = self.options, req.stats, time.perf_counter()
        # a full save writes each block as soon as it has landed
        landing = req.snapshot.landing() if self.tracker is None else None
        host, decision = self._host(req, landing is None)
        path = os.path.join(partial, name)
        rootdir.make_dirs(os.path.dirname(path))
        codecs = None
        if o.compression is not None:
            pick = o.compression
            codecs = {n: c for n, t in host.items()  # a chunk must be one checksum block
                      if t.numel() * t.element_size() >= MIN_COMPRESS
                      and o.block % t.element_size() == 0 and (c := pick(n))}
        t1 = time.perf_counter()
        attrs = self._attrs(req)
        template = None if codecs else self.templates.get(host, attrs, alignment=o.alignment,
                                                          block=o.block)
        if pool is not None and template is not None and into is None:
            stats["recycled"] = float(rootdir.take(pool, name, path))
        writer = ShardWriter(path, host, attrs, alignment=o.alignment, into=into,
                             codecs=codecs, block=o.block, template=template)
        try:
            if started is not None:
                started(writer, host, landing)
            t2 = time.perf_counter()
            writer.write(host, block=o.block, threads=o.io_threads,
                         on_block=lambda: faults.hit("mid-write", self.rank, req.step),
                         digests=decision.digests,
                         meanwhile=None if landing is None else lambda: self._landed(req, landing),
                         gate=None if landing is None else landing.gate)
            t3 = time.perf_counter()
            size = writer.seal()
            stats.update(create_s=t2 - t1, data_s=t3 - t2, seal_s=time.perf_counter() - t3)
        except BaseException as e:
            writer.close()
            if landing is not None:  # whoever else waits on it (a partner stream) waits no more
                landing.finish(e)
            if isinstance(e, OSError) and e.filename is None:  # pwrite and fsync name no file
                raise OSError(e.errno, e.strerror, path) from e
            raise
        return self._entry(req, name, size, writer.records, decision, t0)

    def fileless(self, req: SaveRequest) -> RankEntry | None:
        """This rank's entry without a file, where it has no tensor to write (the replicated
        tensors of a small state go to other ranks: ``Files(min_write_share=)``) and nothing to
        refer to (a full save): its tree goes in the manifest and nothing needs to be made
        durable. None where it has a shard to write."""
        assert req.snapshot is not None and req.tree is not None
        if req.snapshot.count or self.tracker is not None:  # (its tensors may still be landing)
            return None
        t0 = time.perf_counter()
        self._landed(req)
        req.stats.update(create_s=0.0, data_s=0.0, seal_s=0.0)
        return self._entry(req, None, 0, [], Decision(), t0)

    def write_node(self, node: NodeFiles, proto: Protocol, req: SaveRequest, partial: str,
                   error: str | None) -> tuple[RankEntry | None, str | None]:
        """One file per node: this rank's regions of its node's file, written and fsynced with
        the node's ranks (collective over the node, also for a rank that failed); its entry, or
        the error."""
        t0 = time.perf_counter()
        host, decision, attrs = None, Decision(), {}
        path = os.path.join(partial, node.name())
        if error is None:
            try:
                assert req.snapshot is not None and req.tree is not None
                host, decision = self._host(req)
                attrs = self._attrs(req)
                rootdir.make_dirs(os.path.dirname(path))
            except Exception as e:
                error = error_text(e)
        o = self.options
        try:
            with proto.fatal_timeouts(self.log):
                records, size = nodefile.write(
                    node, path, self.rank, host, attrs, error,
                    alignment=o.alignment, block=o.block, threads=o.io_threads,
                    digests=decision.digests,
                    on_block=lambda: faults.hit("mid-write", self.rank, req.step),
                    times=req.stats)
            if error is not None:
                return None, error
            return self._entry(req, node.name(), size, records, decision, t0), None
        except Exception as e:
            return None, error or error_text(e)

    def write_index(self, partial: str, entry: RankEntry) -> None:
        """This rank's index part (its entry as JSON), durable before it votes."""
        data = json.dumps(entry.to_dict(), allow_nan=False).encode()
        name = index_name(self.rank, self.world_size, self.options.fanout)
        rootdir.make_dirs(os.path.join(partial, os.path.dirname(name)))
        rootdir.atomic_write(os.path.join(partial, name), data)
        entry.index = IndexRef(name, len(data), checksum.digest(data))

    def _host(self, req: SaveRequest, wait: bool = True) -> tuple[dict[str, torch.Tensor],
                                                                  Decision]:
        """The snapshot's tensors once copied (unless not ``wait``: they are landing), less
        those an incremental save refers to."""
        assert req.snapshot is not None
        if wait:
            self._landed(req)
        host = req.snapshot.tensors
        decision = self._decide(req)
        if decision.reused:
            host = {n: t for n, t in host.items() if n not in decision.reused}
        return host, decision

    @staticmethod
    def _landed(req: SaveRequest, landing: Landing | None = None) -> None:
        """Wait for the snapshot's copies, emptying its staging buffers into host memory (and
        telling ``landing`` how far as it goes); its figure ``copy_s``."""
        assert req.snapshot is not None
        req.snapshot.wait(landing)
        req.stats["copy_s"] = req.snapshot.copy_s or req.stats["stall_s"]
        req.stats.update({f"copy_{k}": v for k, v in req.snapshot.parts.items()})

    def _attrs(self, req: SaveRequest) -> dict[str, str | int]:
        """The attributes of a rank's shard (or of its group in a node's file)."""
        return {"rank": self.rank, "step": req.step, "world_size": self.world_size,
                "tree": self._tree_text(req.tree)}

    def _tree_text(self, tree: Any) -> str:
        """``tree`` as JSON; the last save's text where the tree is the same value
        (:func:`~mpickpt.format.manifest.tree_key`: 1.2 ms for 8,000 tensors' tree, its JSON
        9 ms)."""
        key, last = tree_key(tree), self._tree
        if key is not None and last is not None and last[0] == key:
            return last[1]
        text = json.dumps(tree, allow_nan=False)
        self._tree = None if key is None else (key, text)
        return text

    def _entry(self, req: SaveRequest, name: str | None, size: int, records: list[TensorRecord],
               decision: Decision, t0: float) -> RankEntry:
        """This rank's entry once its shard is durable: the written records with their pieces'
        placements, and those an incremental save refers to."""
        assert req.snapshot is not None and req.tree is not None
        stats = req.stats
        for r in records:
            if r.name in req.placements:
                r.global_shape = list(req.placements[r.name].global_shape)
                r.offsets = list(req.placements[r.name].offsets)
        stats["persist_s"] = time.perf_counter() - t0
        stats["persist_GBps"] = size / max(stats["persist_s"], 1e-9) / 1e9
        faults.hit("after-fsync-before-vote", self.rank, req.step)
        if decision.reused:
            written = {r.name: r for r in records}
            records = [written.get(n) or decision.reused[n]
                       for n in [*req.snapshot.tensors, *req.elided]]
        return RankEntry(self.rank, name, size, req.tree, records, sources=decision.sources)

    def _decide(self, req: SaveRequest) -> Decision:
        """An incremental save: which tensors are unchanged since the last commit (referred to,
        not written) and the digests of the others; a full save decides nothing."""
        if self.tracker is None:
            return Decision()
        assert req.snapshot is not None
        t = time.perf_counter()
        d = self.tracker.decide(req.step, req.snapshot.tensors, req.placements,
                                self.options.block, self.options.io_threads, req.elided)
        req.stats.update(compare_s=time.perf_counter() - t, hashed_bytes=d.hashed_bytes,
                         reused_bytes=sum(r.nbytes for r in d.reused.values()))
        if d.lost:
            self.log.warning("rank %d: step %d is written in full: the last checkpoint's file "
                             "cannot be referred to: %s", self.rank, req.step, d.why_full)
        return d
