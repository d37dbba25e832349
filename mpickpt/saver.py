"""The save pipeline, on one background thread per Checkpointer: write, vote, commit (or abort).

The training thread hands over a :class:`SaveRequest` (the snapshot and what describes it) and
gets a :class:`SaveHandle` at once. The background thread then, in order:

1. **write**: the rank's shard into ``step-XXXXXXXX.partial-<run>/``, fsynced: a
   :class:`~mpickpt.manifest.RankEntry`;
2. **vote**: an allreduce of success flags; any failure aborts on every rank, naming the ranks
   and reasons, and the partial directory goes;
3. **commit** (rank 0): the ranks' entries become the :class:`~mpickpt.manifest.Manifest` (by the
   rules a parsed one obeys), the pieces of every sharded tensor must tile it, every shard must
   be where rank 0 sees it; then MANIFEST.json is written and the directory renamed into place;
   every rank learns the outcome, a :class:`SaveResult`;
4. **after the commit** (rank 0): :class:`~mpickpt.upkeep.Upkeep` (figures, retention).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import checksum, commit, faults, log, nodefile, retention, rootdir, sharding
from . import metadata as user_metadata
from .checksum import DEFAULT_BLOCK
from .codec import MIN_BYTES as MIN_COMPRESS
from .errors import CheckpointError
from .incremental import Decision, Tracker, size_problem
from .manifest import FANOUT, IndexRef, Manifest, RankEntry, index_name, read_bytes, shard_name
from .protocol import Protocol, ranks_text
from .records import TensorRecord
from .request import SaveHandle, SaveRequest, SaveResult, SkipLog
from .shard import DEFAULT_ALIGNMENT, ShardWriter
from .snapshot import Snapshotter
from .upkeep import Upkeep

if TYPE_CHECKING:
    import torch

    from .levels import LocalLevel
    from .nodefile import NodeFiles


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
    per_node: bool = False  # one file per node (mpickpt.nodefile)
    fanout: int = FANOUT  # shards (and index parts) per directory, at most

    def extended(self, world_size: int) -> bool:
        """Whether manifests of ``world_size`` ranks are version 3 (incremental or compressed
        records, node files, sub-directories); 0 for the node-local level's (flat, per rank)."""
        return bool(self.incremental or self.compression or self.per_node
                    or world_size > self.fanout)


class Saver:
    """Runs the pipeline of every save of one Checkpointer on its own thread, in order."""

    def __init__(self, proto: Protocol, root: str, run_id: str, snapshotter: Snapshotter,
                 options: ShardOptions, policy: retention.Policy, logger: logging.Logger,
                 raise_on_error: bool, local: LocalLevel | None = None,
                 skip: bool = False, node: NodeFiles | None = None) -> None:
        self.proto, self.root, self.run_id = proto, root, run_id
        self.rank, self.world_size = proto.rank, proto.size
        self.snapshotter, self.options, self.log = snapshotter, options, logger
        self.upkeep = Upkeep(root, run_id, policy, logger)
        self.raise_on_error = raise_on_error
        self.skip = skip  # if_busy="skip"
        self.skips = SkipLog(logger) if skip and self.rank == 0 else None
        self.last: SaveResult | None = None  # the last committed save
        self.local = local
        self.node = node  # files="per-node": this rank's node
        self.tracker = (Tracker(root, options.incremental, options.frozen)
                        if options.incremental else None)
        self.drained: int | None = None  # the last step the local level drained to ROOT
        self._since_drain = 0  # local commits since the last drain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-persist")
        self._pending: list[SaveHandle] = []
        self._jobs: list[Future[None]] = []  # every job on the thread, drains included

    # ------------------------------------------------------------------- the training thread

    def submit(self, request: SaveRequest) -> SaveHandle:
        """Queue a save; its handle resolves once it is committed at its first level (a drain
        to ROOT that follows runs on in the background)."""
        first: Future[SaveResult] = Future()
        handle = SaveHandle(request.step, first, self.raise_on_error)
        self._track(self._thread.submit(self._job, request, first))
        self._pending.append(handle)
        return handle

    def scavenge(self) -> None:
        """Queue the drain to ROOT of the newest local checkpoint, unless it is there already
        (the end of a job: SCR's scavenge)."""
        if self.local is not None:
            self._track(self._thread.submit(self._scavenge))

    def _track(self, job: Future[None]) -> None:
        self._jobs = [j for j in self._jobs if not j.done()] + [job]

    def report_finished(self) -> None:
        """Forget finished saves; with on_error="raise", raise for a failure nobody waited for."""
        still, failed = [], None
        for h in self._pending:
            if not h.done():
                still.append(h)
            elif not h.reported and not h.outcome().committed and not h.outcome().skipped:
                failed = failed or h
        self._pending = still
        if failed is not None and self.raise_on_error:
            failed.wait()

    def wait(self) -> list[SaveResult]:
        """Block until every save in flight is committed or aborted; their results."""
        for job in self._jobs:
            job.result()
        results = [h.outcome() for h in self._pending]
        self.report_finished()
        return results

    def finish(self, why: str) -> bool:
        """At the end of the program without close(): wait for the saves in flight, saying so;
        whether they all committed."""
        if self._pending and self.rank == 0:
            steps = ", ".join(str(h.step) for h in self._pending)
            self.log.warning("%s: waiting for the save of step %s to commit", why, steps)
        self.scavenge()
        for job in self._jobs:
            job.result()
        results, self._pending = [h.outcome() for h in self._pending], []
        failed = [r for r in results if not r.committed and not r.skipped]
        for r in failed:
            self.log.error("%s, and the save of step %d could not commit (%s): it is lost",
                           why, r.step, r.error)
        return not failed

    def shutdown(self) -> None:
        self._thread.shutdown()

    # ----------------------------------------------------------------- the background thread

    def _job(self, req: SaveRequest, first: Future[SaveResult]) -> None:
        """One save on the background thread: the save, then (local level) the drain if due."""
        try:
            result = self._skipped(req)
            if result is None:
                result = self._run(req) if self.local is None else self._run_local(req)
        except BaseException as e:  # the handle must not wait forever
            first.set_exception(e)
            raise
        first.set_result(result)
        if self.local is not None and result.committed:
            self._since_drain += 1
            every = self.local.persist_every
            if req.drain or (every and self._since_drain >= every):
                self._drain(result.step)

    def _skipped(self, req: SaveRequest) -> SaveResult | None:
        """if_busy="skip": a save some rank took no snapshot of (its buffers were all in flight)
        is skipped on every rank, decided by one allreduce before anything is written."""
        if not self.skip:
            return None
        with self.proto.fatal_timeouts(self.log):
            taken = self.proto.all_ok(not req.busy, "busy")
        if self.skips is not None:
            self.skips.saw(req.step, not taken)
        if taken:
            return None
        if req.snapshot is not None:
            self.snapshotter.release(req.snapshot)
        return SaveResult(req.step, False, error="skipped: an earlier save was still persisting",
                          stats=req.stats, skipped=True)

    def _run(self, req: SaveRequest) -> SaveResult:
        partial = os.path.join(self.root, rootdir.partial_name(req.step, self.run_id))
        entry, error = None, req.error
        try:
            if self.node is not None:
                entry, error = self._write_node(req, partial, error)
                if self.options.split_index:
                    with self.proto.fatal_timeouts(self.log):
                        ref = nodefile.write_index(self.node, partial, entry, error)
                    if entry is not None:
                        entry.index = ref
            elif req.snapshot is not None and req.tree is not None:
                entry = self._write(req, partial)
                if self.options.split_index:
                    self._write_index(partial, entry)
        except Exception as e:
            entry, error = None, f"{type(e).__name__}: {e}"
        finally:
            if req.snapshot is not None:  # also when it failed before draining
                self.snapshotter.release(req.snapshot)
        with self.proto.fatal_timeouts(self.log):
            before = self.proto.collectives
            result = self._vote_and_commit(req, partial, entry, error)
            req.stats["collectives"] = self.proto.collectives - before
        if self.tracker is not None and result.committed and entry is not None:
            self.tracker.committed(result.step, entry)
        self._after(req, result)
        return result

    def _after(self, req: SaveRequest, result: SaveResult) -> None:
        """Record a committed save and tidy up after it; log an aborted one."""
        if result.committed and result.level == "local":
            self.last = result
            self._tidy_local(result)
            return
        if result.committed:
            self.last = result
            try:
                if self.rank == 0:
                    self.upkeep.after_commit(result.step, result.path, result.stats,
                                             result.metadata)
                else:
                    faults.hit("after-commit-before-retention", self.rank, result.step)
            except Exception as e:  # the checkpoint is committed on every rank all the same
                self.log.error("checkpoint step %d is committed, but what follows the commit "
                               "failed on rank %d: %s: %s", result.step, self.rank,
                               type(e).__name__, e)
        else:
            self.log.error("checkpoint of step %d aborted on all ranks: %s; the previous "
                           "checkpoints are untouched and training goes on", req.step,
                           result.error)

    def _write(self, req: SaveRequest, partial: str, mapped: bool = False) -> RankEntry:
        """Stage 1: this rank's shard, written and fsynced."""
        assert req.snapshot is not None and req.tree is not None
        stats, t0 = req.stats, time.perf_counter()
        host, decision = self._host(req)
        # the node-local level keeps its shards flat (its tools and recovery name them so)
        name = shard_name(self.rank) if self.local is not None else \
            shard_name(self.rank, self.world_size, self.options.fanout)
        path = os.path.join(partial, name)
        rootdir.make_dirs(os.path.dirname(path))
        codecs = None
        if self.options.compression is not None:
            pick = self.options.compression
            codecs = {n: c for n, t in host.items()  # a chunk must be one checksum block
                      if t.numel() * t.element_size() >= MIN_COMPRESS
                      and self.options.block % t.element_size() == 0 and (c := pick(n))}
        t1 = time.perf_counter()
        writer = ShardWriter(
            path, host, self._attrs(req),
            alignment=self.options.alignment, mapped=mapped, codecs=codecs,
            block=self.options.block,
        )
        try:
            t2 = time.perf_counter()
            writer.write(host, block=self.options.block, threads=self.options.io_threads,
                         on_block=lambda: faults.hit("mid-write", self.rank, req.step),
                         digests=decision.digests)
            t3 = time.perf_counter()
            size = writer.seal()
            stats.update(create_s=t2 - t1, data_s=t3 - t2, seal_s=time.perf_counter() - t3)
        except OSError as e:
            writer.close()
            if e.filename is None:  # pwrite and fsync name no file: say which
                raise OSError(e.errno, e.strerror, path) from e
            raise
        except BaseException:
            writer.close()
            raise
        return self._entry(req, name, size, writer.records, decision, t0)

    def _write_node(self, req: SaveRequest, partial: str, error: str | None
                    ) -> tuple[RankEntry | None, str | None]:
        """Stage 1 with one file per node: this rank's regions of its node's file, written and
        fsynced with the node's ranks (collective over the node, also for a rank that failed);
        its entry, or the error."""
        assert self.node is not None
        t0 = time.perf_counter()
        host, decision, attrs = None, Decision(), {}
        name = self.node.name()
        path = os.path.join(partial, name)
        if error is None:
            try:
                assert req.snapshot is not None and req.tree is not None
                host, decision = self._host(req)
                attrs = self._attrs(req)
                rootdir.make_dirs(os.path.dirname(path))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        try:
            with self.proto.fatal_timeouts(self.log):
                records, size = nodefile.write(
                    self.node, path, self.rank, host, attrs, error,
                    alignment=self.options.alignment, block=self.options.block,
                    threads=self.options.io_threads, digests=decision.digests,
                    on_block=lambda: faults.hit("mid-write", self.rank, req.step),
                    times=req.stats)
            if error is not None:
                return None, error
            return self._entry(req, name, size, records, decision, t0), None
        except Exception as e:
            return None, error or f"{type(e).__name__}: {e}"

    def _host(self, req: SaveRequest) -> tuple[dict[str, torch.Tensor], Decision]:
        """The snapshot's tensors once copied, less those an incremental save refers to."""
        assert req.snapshot is not None
        req.snapshot.wait()
        req.stats["copy_s"] = req.snapshot.copy_s or req.stats["stall_s"]
        host = req.snapshot.tensors
        decision = self._decide(req)
        if decision.reused:
            host = {n: t for n, t in host.items() if n not in decision.reused}
        return host, decision

    def _attrs(self, req: SaveRequest) -> dict[str, str | int]:
        """The attributes of a rank's shard (or of its group in a node's file)."""
        return {"rank": self.rank, "step": req.step, "world_size": self.world_size,
                "tree": json.dumps(req.tree, allow_nan=False)}

    def _entry(self, req: SaveRequest, name: str, size: int, records: list[TensorRecord],
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

    def _write_index(self, partial: str, entry: RankEntry) -> None:
        """This rank's index part (its entry as JSON), durable before it votes."""
        data = json.dumps(entry.to_dict(), allow_nan=False).encode()
        name = index_name(self.rank, self.world_size, self.options.fanout)
        rootdir.make_dirs(os.path.join(partial, os.path.dirname(name)))
        rootdir.atomic_write(os.path.join(partial, name), data)
        entry.index = IndexRef(name, len(data), checksum.digest(data))

    def _vote_and_commit(self, req: SaveRequest, partial: str, entry: RankEntry | None,
                         error: str | None, local: bool = False) -> SaveResult:
        """Stages 2 and 3: every rank votes; rank 0 commits (``local``: assembles the manifest
        that every node then publishes); every rank learns the outcome."""
        step, stats = req.step, req.stats
        owner = self.local.leader if local and self.local else self.rank == 0
        if failed := self.proto.agree(error, "vote", report="abort"):
            if owner:
                self._discard(partial)
            return SaveResult(step, False, error=failed.named(), stats=stats)
        payload: dict[str, Any] | None = None
        try:
            if self.rank != 0:  # voted yes; rank 0 cannot write the manifest without its entry
                faults.hit("after-vote-before-manifest", self.rank, step)
            payload = None if entry is None else (
                entry.summary() if entry.index is not None else entry.to_dict())
        except Exception as e:  # rank 0 aborts the commit, naming this rank
            payload = {"error": f"rank {self.rank}: {type(e).__name__}: {e}"}
        entries = self.proto.gather(payload, "gather")
        outcome: tuple[str | None, str | None, dict[str, Any]] = (None, None, {})
        if self.rank == 0:
            t = time.perf_counter()
            try:
                faults.hit("after-vote-before-manifest", 0, step)
                failed = [e["error"] for e in entries or [] if e and "error" in e]
                if failed:
                    raise CheckpointError("; ".join(failed))
                metadata = user_metadata.resolve(req.metadata)
                manifest = Manifest.assemble(step, self.world_size, self.run_id, entries or [],
                                             metadata, self.options.block, directory=partial,
                                             extended=self.options.extended(
                                                 0 if local else self.world_size))
                if not manifest.split or self.world_size <= CHECK_PIECES_RANKS:
                    _check_pieces(manifest.ranks)  # with index parts: reads them all
                    _check_sources(partial, manifest.ranks)
                if local:  # every node publishes it
                    outcome = (manifest.to_json(), None, metadata)
                else:
                    _check_shards(partial, manifest.ranks)
                    outcome = (self._commit(partial, manifest, stats), None, metadata)
                stats["commit_s"] = time.perf_counter() - t
                stats["bytes"] = manifest.total_bytes
            except Exception as e:
                outcome = (None, f"rank 0: commit failed: {type(e).__name__}: {e}", {})
                if not local:
                    self._discard(partial)
        else:  # rank 0 writes the manifest and commits while this rank waits for the outcome
            try:
                faults.hit("mid-manifest-write", self.rank, step)
            except Exception as e:  # rank 0 decides alone now: wait for its outcome
                self.log.error("rank %d: %s: %s while rank 0 commits step %d", self.rank,
                               type(e).__name__, e, step)
        path, error, metadata = self.proto.bcast(outcome, "commit")
        if local:
            return self._publish_local(req, partial, path, error, metadata)
        return SaveResult(step, error is None, path=path, error=error, stats=stats,
                          metadata=metadata)

    # --------------------------------------------------------------------- the node-local level

    def _run_local(self, req: SaveRequest) -> SaveResult:
        """Write into the node-local directory, protect over MPI, vote, commit on every node."""
        lv = self.local
        assert lv is not None
        partial = lv.tier.partial(req.step, self.run_id)
        entry, error = None, req.error
        try:
            if req.snapshot is not None and req.tree is not None:
                lv.check_room(req.snapshot.nbytes, req.snapshot.count, self.rank)
                entry = self._write(req, partial, mapped=lv.mapped)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            if req.snapshot is not None:
                self.snapshotter.release(req.snapshot)
        with self.proto.fatal_timeouts(self.log):
            if lv.exchange is not None:
                error = self._protect(req, partial, entry, error)
            result = self._vote_and_commit(req, partial, entry, error, local=True)
        self._after(req, result)
        return result

    def _protect(self, req: SaveRequest, partial: str, entry: RankEntry | None,
                 error: str | None) -> str | None:
        """The redundancy exchange, once every rank has its shard (a rank that could not write
        must not leave its partner waiting); this rank's error, if any."""
        lv = self.local
        assert lv is not None and lv.exchange is not None
        if not self.proto.all_ok(error is None, "local-write"):
            return error or "the save aborted: another rank could not write its shard"
        assert entry is not None
        t = time.perf_counter()
        try:
            moved = lv.exchange.protect(
                partial, os.path.join(partial, entry.file), entry.bytes, lv.names,
                on_window=lambda: faults.hit("mid-exchange", self.rank, req.step))
            faults.hit("after-exchange-before-vote", self.rank, req.step)
        except Exception as e:
            return f"the {lv.scheme} exchange failed: {type(e).__name__}: {e}"
        req.stats.update(protect_s=time.perf_counter() - t, sent_bytes=moved.sent)
        return None

    def _publish_local(self, req: SaveRequest, partial: str, text: str | None,
                       error: str | None, metadata: dict[str, Any]) -> SaveResult:
        """Every node's leader writes the manifest into its partial directory and renames it
        into place; the step is protected once every node did."""
        lv = self.local
        assert lv is not None
        step = req.step
        if error is None:
            try:
                faults.hit("mid-local-commit", self.rank, step)
                if lv.leader:
                    assert text is not None
                    lv.tier.publish(partial, step, text.encode(), lv.level_record())
            except Exception as e:
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        elif lv.leader:
            self._discard(partial)
        if failed := self.proto.agree(error, "local-commit"):
            reasons = str(failed)
            if lv.leader:
                self._discard(lv.tier.final(step))
                self._discard(partial)
            return SaveResult(step, False, error=reasons, stats=req.stats, level="local")
        req.stats["protected_s"] = time.perf_counter() - req.started
        return SaveResult(step, True, path=lv.tier.final(step), stats=req.stats,
                          metadata=metadata, level="local")

    def _tidy_local(self, result: SaveResult) -> None:
        """After a local commit: say so (rank 0) and keep the newest local steps (leaders)."""
        lv = self.local
        assert lv is not None
        s = result.stats
        if self.rank == 0:
            self.log.info("checkpoint step %d protected on the nodes (%s) %.2f s after save(): "
                          "%s", result.step, lv.scheme or "no redundancy",
                          s.get("protected_s", 0.0), log.human_bytes(int(s.get("bytes", 0))))
        if lv.leader:
            try:
                lv.tier.retain(lv.keep, self.run_id, result.step)
            except OSError as e:
                self.log.warning("rank %d: could not remove an old local checkpoint: %s",
                                 self.rank, e)

    def _scavenge(self) -> None:
        last = self.last
        if last is not None and last.level == "local" and self.drained != last.step:
            self._drain(last.step)

    def _drain(self, step: int) -> SaveResult:
        """Copy every rank's shard of a committed local checkpoint to ROOT, vote, commit there
        as any save (the local copy is not snapshotted again)."""
        lv = self.local
        assert lv is not None
        self._since_drain = 0
        partial = os.path.join(self.root, rootdir.partial_name(step, self.run_id))
        error, stats, t = None, {}, time.perf_counter()
        try:
            rootdir.make_dirs(partial)
            name = shard_name(self.rank)
            stats["drained_bytes"] = lv.drain_copy(
                os.path.join(lv.tier.final(step), name), os.path.join(partial, name),
                on_chunk=lambda: faults.hit("mid-drain", self.rank, step))
        except Exception as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        with self.proto.fatal_timeouts(self.log):
            if failed := self.proto.agree(error, "drain"):
                why = str(failed)
                if self.rank == 0:
                    self._discard(partial)
                    self.log.error("the drain of step %d to ROOT failed, ROOT is unchanged and "
                                   "the step stays protected on the nodes: %s", step, why)
                return SaveResult(step, False, error=why)
            outcome: tuple[str | None, str | None] = (None, None)
            if self.rank == 0:
                try:
                    faults.hit("mid-drain-commit", 0, step)
                    manifest = Manifest.from_json(read_bytes(lv.tier.final(step)).decode(),
                                                  lv.tier.final(step))
                    _check_shards(partial, manifest.ranks)
                    stats["drain_s"] = time.perf_counter() - t
                    outcome = (self._commit(partial, manifest, stats), None)
                    self.log.info("drained step %d to ROOT in %.2f s", step, stats["drain_s"])
                except Exception as e:
                    outcome = (None, f"rank 0: {type(e).__name__}: {e}")
                    if not os.path.lexists(os.path.join(self.root, rootdir.step_name(step))):
                        self._discard(partial)
            else:
                try:
                    faults.hit("mid-drain-commit", self.rank, step)
                except Exception as e:
                    self.log.error("rank %d: %s: %s while rank 0 commits the drain of step %d",
                                   self.rank, type(e).__name__, e, step)
            path, error = self.proto.bcast(outcome, "drain-commit")
        if error is None and self.rank == 0:
            last = self.last.stats if self.last and self.last.step == step else {}
            try:
                self.upkeep.after_commit(step, path, {"stall_s": 0.0, **last, **stats},
                                         manifest.metadata)
            except Exception as e:  # the drain is committed all the same
                self.log.error("step %d is drained to ROOT, but what follows the commit "
                               "failed: %s: %s", step, type(e).__name__, e)
        if error is None:
            self.drained = step
            if self.last is not None and self.last.step == step:
                self.last.stats["drain_s"] = time.perf_counter() - t
        elif self.rank == 0:
            self.log.error("the drain of step %d to ROOT failed, the step stays protected on "
                           "the nodes: %s", step, error)
        return SaveResult(step, error is None, path=path, error=error, stats=stats)

    def _commit(self, partial: str, manifest: Manifest, stats: dict[str, Any]) -> str:
        """Publish: manifest into the partial directory, then the directory into place."""
        text = manifest.to_json().encode()
        stats["manifest_bytes"] = len(text)
        step = manifest.step
        return commit.publish(self.root, partial, step, text,
                              existing=lambda final: self._replace(step, final),
                              on_half=lambda: faults.hit("mid-manifest-write", 0, step))

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

    def _discard(self, partial: str) -> None:
        try:
            if os.path.lexists(partial):
                rootdir.remove(partial, self.run_id)
        except OSError as e:
            self.log.warning("could not remove %s (%s); it is removed at the next start",
                             partial, log.os_error(e, partial))


# with index parts, rank 0 reads them all to check that sharded tensors tile at the commit up to
# this many ranks; beyond, restore checks the pieces it reads (and names any that do not tile)
CHECK_PIECES_RANKS = 64


def _check_pieces(ranks: list[RankEntry]) -> None:
    """Before the commit: the written pieces of every sharded or replicated tensor must tile it
    exactly (ValueError, which aborts the save, otherwise)."""
    pieces: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]]]
    pieces = {}
    for e in ranks:
        for r in e.tensors:
            if r.global_shape is not None and r.offsets is not None:
                pieces.setdefault(r.name, []).append(
                    (e.rank, tuple(r.global_shape), tuple(r.offsets), tuple(r.shape), r.dtype))
    sharding.check_coverage(pieces)


def _check_sources(partial: str, ranks: list[RankEntry]) -> None:
    """Before the commit of an incremental checkpoint, on rank 0: the older shards its records
    refer to are still there, of the sizes they were written with (a prune while it was
    written would leave it unloadable)."""
    for e in ranks:
        for f in e.files(partial)[1:]:
            why = size_problem(f.path, f.bytes)
            if why is not None:
                raise CheckpointError(f"rank {e.rank} refers to an older shard: {why}")


def _check_shards(partial: str, ranks: list[RankEntry]) -> None:
    """Before the commit, on rank 0: every rank's shard is in the partial directory as rank 0
    sees it, of the size its rank wrote (a ROOT that is not shared leaves them elsewhere); the
    entries of its sub-directories are made durable (the manifest's write syncs the top)."""
    found = commit.presence(partial, ranks)
    if found.missing:
        raise CheckpointError(f"the shards of {ranks_text(found.missing)} are not in {partial} "
                              "as rank 0 sees it, although they were written: "
                              f"{rootdir.NOT_SHARED_ADVICE}")
    if found.wrong_size:
        raise CheckpointError(f"the shards of {ranks_text(found.wrong_size)} in {partial} are "
                              "not of the size their ranks wrote")
