"""The save pipeline, on one background thread per Checkpointer: one sequence, any store.

The training thread hands over a :class:`~mpickpt.save.request.SaveRequest` (the snapshot and what
describes it) and gets a :class:`~mpickpt.save.request.SaveHandle` at once. The background thread
then runs, for the save's store (:mod:`mpickpt.save.store`: ROOT, or the node-local level):

1. **write**: the rank's shard into the store's partial directory, fsynced;
2. **protect**: the store's redundancy (the node-local level's partner copies or parity);
3. **vote**: any failure aborts on every rank, naming the ranks and reasons, and the partial
   directory goes;
4. **assemble** (rank 0, :mod:`mpickpt.save.assemble`) and **publish**: the store's commit,
   whose outcome every rank learns as a :class:`~mpickpt.save.request.SaveResult`;
5. **retain**: what follows a commit (figures, retention), or the abort logged.

With a node-local level, every ``persist_every``-th committed save (and the emergency one, and
the last at the end) is then **drained**: the same steps from the node store into ROOT, the
write being a copy of the node's committed shard and the manifest the node's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import faults
from ..errors import RankFailure
from ..format.manifest import Memo
from ..mpi.protocol import Protocol
from .assemble import assemble
from .request import SaveHandle, SaveRequest, SaveResult, SkipLog
from .rootstore import RootStore
from .shards import error_text
from .snapshot import Snapshotter
from .store import Store


class Pipeline:
    """Runs every save of one Checkpointer on its own thread, in order: into ``store`` (ROOT's,
    or the node store, whose saves ``root`` then drains), by the steps of :class:`Store`."""

    def __init__(self, proto: Protocol, run_id: str, snapshotter: Snapshotter, store: Store,
                 root: RootStore, logger: logging.Logger, raise_on_error: bool,
                 persist_every: int | None = None, drain_bandwidth: float | None = None,
                 skip: bool = False) -> None:
        self.proto, self.run_id, self.snapshotter = proto, run_id, snapshotter
        self.store, self.root, self.log = store, root, logger
        self.rank = proto.rank
        self.raise_on_error = raise_on_error
        self.persist_every, self.drain_bandwidth = persist_every, drain_bandwidth
        self.skip = skip  # if_busy="skip"
        self.skips = SkipLog(logger) if skip and self.rank == 0 else None
        self.last: SaveResult | None = None  # the last committed save
        self.drained: int | None = None  # the last step drained from the node store to ROOT
        self._since_drain = 0  # node commits since the last drain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-persist")
        self._pending: list[SaveHandle] = []
        self._jobs: list[Future[None]] = []  # every job on the thread, drains included
        self._entries = Memo()  # rank 0: the entries of the last manifest assembled

    @property
    def drains(self) -> bool:
        """Whether saves go to another store first, and from there to ROOT."""
        return self.store is not self.root

    # ------------------------------------------------------------------- the training thread

    def submit(self, request: SaveRequest) -> SaveHandle:
        """Queue a save; its handle resolves once it is committed in its store (a drain to
        ROOT that follows runs on in the background)."""
        first: Future[SaveResult] = Future()
        handle = SaveHandle(request.step, first, self.raise_on_error, self.proto.waker)
        self._queue(self._job, request, first)
        self._pending.append(handle)
        return handle

    def scavenge(self) -> None:
        """Queue the drain to ROOT of the newest node-local checkpoint, unless it is there
        already (the end of a job: SCR's scavenge)."""
        if self.drains:
            self._queue(self._scavenge)

    def later(self, job: Callable[[], None]) -> None:
        """Run ``job`` (collective, on every rank alike) on the save thread, after what is
        queued there: the write-back of a restore's rebuilt shards."""
        def run() -> None:
            with self.proto.fatal_timeouts(self.log):
                job()

        self._queue(run)

    def settle(self) -> None:
        """Wait for what is queued on the save thread (a restore's write-back), without raising:
        a collective of the calling thread must not run beside its, on one communicator."""
        with self.proto.waker.wanted():
            concurrent.futures.wait(self._jobs)

    def _queue(self, job: Callable[..., None], *args: Any) -> None:
        """Run ``job(*args)`` on the save thread after what is queued there; until it starts,
        the waits of the one running do not doze (:class:`~mpickpt.mpi.polling.Waker`)."""
        waker = self.proto.waker

        def started() -> None:
            waker.want(-1)
            job(*args)

        waker.want(1)
        try:
            future = self._thread.submit(started)
        except BaseException:
            waker.want(-1)
            raise
        self._jobs = [j for j in self._jobs if not j.done()] + [future]

    def _join(self) -> None:
        """Wait for every job on the save thread (raising its error), which then dozes not."""
        with self.proto.waker.wanted():
            for job in self._jobs:
                job.result()

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
        self._join()
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
        self._join()
        pending, self._pending = self._pending, []
        # a failure already raised to the caller (a state it cannot save) is not lost here
        failed = [r for h in pending if not h.reported
                  and not (r := h.outcome()).committed and not r.skipped]
        for r in failed:
            self.log.error("%s, and the save of step %d could not commit (%s): it is lost",
                           why, r.step, r.error)
        return not failed

    def time_for(self, step: int, deadline: float | None) -> bool:
        """Collective: whether an emergency save of ``step`` can commit before ``deadline``
        (Unix time), judged by rank 0's figures of the last commit with a margin of a quarter;
        every rank decides alike, so all save or none does. Rank 0 says why not."""
        last, need = self.last, None
        if last is not None:
            s = last.stats
            need = 1.25 * (s.get("stall_s", 0) + s.get("persist_s", 0) + s.get("commit_s", 0)
                           + s.get("protect_s", 0) + s.get("drain_s", 0))
        left = None if deadline is None else deadline - time.time()
        with self.proto.fatal_timeouts(self.log):
            need, left = self.proto.bcast((need, left), "emergency")
        if need is None or left is None or need <= left:
            return True
        if self.rank == 0:
            self.log.error("no time for the emergency checkpoint of step %d: it needs about "
                           "%.0f s, the job ends in %.0f s; the job will resume from step %s",
                           step, need, left, last.step if last else None)
        return False

    def shutdown(self) -> None:
        with self.proto.waker.wanted():
            self._thread.shutdown()

    # ----------------------------------------------------------------- the background thread

    def _job(self, req: SaveRequest, first: Future[SaveResult]) -> None:
        """One save on the background thread, then the drain to ROOT if one is due."""
        try:
            result = self._skipped(req) or self._save(req)
        except BaseException as e:  # the handle must not wait forever
            first.set_exception(e)
            raise
        first.set_result(result)
        if self.drains and result.committed:
            self._since_drain += 1
            every = self.persist_every
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

    def _save(self, req: SaveRequest) -> SaveResult:
        """Write, protect, vote (each rank's entry, or why it has none, gathered by rank 0),
        publish, retain: one save into the store."""
        store, step, stats = self.store, req.step, req.stats
        partial = store.partial(step)
        try:
            entry, error = store.write(req, partial)
        finally:
            if req.snapshot is not None:  # also when it failed before copying
                self.snapshotter.release(req.snapshot)
        with self.proto.fatal_timeouts(self.log):
            error = store.protect(req, partial, entry, error)
            before = self.proto.collectives
            vote = assemble(self.proto, self.run_id, req, partial, entry, error,
                            self.root.shards.options.block, store.extended, self.log,
                            self._entries)
            out = store.publish(step, partial, vote.manifest, vote.error, stats, req.started,
                                vote.failures)
            result = SaveResult(step, out.error is None, path=out.path, error=out.error,
                                stats=stats, metadata=out.metadata, level=store.level,
                                failures=list(out.failures))
            stats["collectives"] = self.proto.collectives - before
        if result.committed:
            self.last = result
            store.retain(result, entry)
        else:
            self.log.error("checkpoint of step %d aborted on all ranks: %s; the previous "
                           "checkpoints are untouched and training goes on", step, result.error)
        return result

    def _scavenge(self) -> None:
        last = self.last
        if last is not None and last.level != self.root.level and self.drained != last.step:
            self._drain(last.step)

    def _drain(self, step: int) -> SaveResult:
        """The save's steps again, from the node store into ROOT: write (a copy of this rank's
        committed shard), vote, publish rank 0's copy of the node's manifest, retain. The step
        stays protected on the nodes whatever becomes of it."""
        source, root = self.store, self.root
        self._since_drain = 0
        partial = root.partial(step)
        stats: dict[str, float] = {}
        t = time.perf_counter()
        error = root.copy_in(source.final(step), partial, step, stats, self.drain_bandwidth)
        with self.proto.fatal_timeouts(self.log):
            if failed := self.proto.agree(error, "drain"):
                root.discard(partial)
                return self._drain_failed(step, str(failed), stats, failed.records)
            manifest = None
            try:
                faults.hit("mid-drain-commit", self.rank, step)
                if self.rank == 0:
                    manifest = source.manifest(step)
                    stats["drain_s"] = time.perf_counter() - t
            except Exception as e:
                if self.rank == 0:
                    error = f"rank 0: {error_text(e)}"
                else:  # rank 0 decides alone now: wait for its outcome
                    self.log.error("rank %d: %s while rank 0 commits the drain of step %d",
                                   self.rank, error_text(e), step)
            out = root.publish(step, partial, manifest, error, stats, phase="drain-commit")
        path = out.path
        if out.error is not None:
            return self._drain_failed(step, out.error, stats, out.failures)
        if self.rank == 0:
            self.log.info("drained step %d to ROOT in %.2f s", step, stats["drain_s"])
        last = self.last.stats if self.last and self.last.step == step else {}
        result = SaveResult(step, True, path=path, stats={"stall_s": 0.0, **last, **stats},
                            metadata=out.metadata)
        root.retain(result, None)
        self.drained = step
        if self.last is not None and self.last.step == step:
            self.last.stats["drain_s"] = time.perf_counter() - t
        return SaveResult(step, True, path=path, stats=stats)

    def _drain_failed(self, step: int, why: str, stats: dict[str, float],
                      failures: tuple[RankFailure, ...]) -> SaveResult:
        if self.rank == 0:
            self.log.error("the drain of step %d to ROOT failed, ROOT is unchanged and the step "
                           "stays protected on the nodes: %s", step, why)
        return SaveResult(step, False, error=why, stats=stats, failures=list(failures))

