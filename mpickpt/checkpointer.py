"""The Checkpointer: consistent global checkpoints by two-phase commit, and coordinated restore.

A facade that assembles the pieces that do the work: :mod:`mpickpt.save.capture` takes the state
off the training thread's tensors (the whole stall), :mod:`mpickpt.save.pipeline` writes, votes
and commits it in the background into its store (ROOT, or the node-local level first),
:mod:`mpickpt.restore.restorer` loads the newest checkpoint every rank can load,
:mod:`mpickpt.mpi.protocol` holds the collectives and their deadlines, :mod:`mpickpt.slurm` what
comes from the scheduler.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from . import knobs, log, preempt, slurm
from .errors import CheckpointError, LocalTierFull, install_hook, mark_agreed
from .exitcodes import EXIT_FAILED, EXIT_PREEMPTED
from .format import codec, rollback, rootdir
from .format.nodefile import NodeFiles
from .format.rollback import Rollback
from .local.level import LocalLevel, open_level
from .local.nodestore import NodeStore
from .local.recovery import LocalRecovery
from .local.topology import Topology
from .mpi.protocol import Protocol, world_rank
from .options import Encoding, Files, Local, Preemption, Retention, Snapshots, gather
from .restore.restorer import RestoreInfo, Restorer
from .save import shared_root
from .save.capture import Capture
from .save.incremental import Tracker
from .save.pinned_pool import HostPool
from .save.pipeline import Pipeline
from .save.request import SaveHandle, SaveRequest, SaveResult
from .save.rootstore import RootStore
from .save.shards import RankShards, ShardOptions
from .save.upkeep import Upkeep

__all__ = ["Checkpointer", "SaveHandle", "SaveResult", "finish_saves"]

T = TypeVar("T")
# index="auto": above this many ranks each rank's records go into an index part of its own
SPLIT_RANKS = 64

# the pipelines of Checkpointers not yet closed: their saves in flight are finished at
# interpreter exit (a pipeline outlives its Checkpointer while a save is in flight)
_OPEN: weakref.WeakSet[Pipeline] = weakref.WeakSet()
_EXIT_HOOKED = False


def _agreed(method: Callable[..., T]) -> Callable[..., T]:
    """A Checkpointer method whose ValueError or CheckpointError is raised alike on every rank
    (a configuration that cannot work, a collective refusal): printed in full by rank 0 only."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except (ValueError, CheckpointError) as e:
            if world_rank() is not None:
                mark_agreed(e)
                install_hook(world_rank)
            raise

    return wrapper


class Checkpointer:
    """Save and restore consistent global checkpoints of every rank's state under ``root``.

    Collective over ``comm`` (``MPI.COMM_WORLD`` by default): every rank constructs it, calls
    ``save`` with the same steps and ``restore`` together. ``keep`` committed checkpoints are kept
    (all when None), or what a :class:`mpickpt.Retention` says (``keep=Retention(3,
    keep_every=1000, best=("val_loss", "min"), keep_best=2)``). A failed save is reported on
    every rank and training goes on (``on_error="warn"``), or raises :class:`SaveAborted` from
    ``wait()`` and from the next ``save()`` (``on_error="raise"``). Collectives that miss
    ``timeout`` seconds abort the job; ``io_threads`` write and read each rank's shard.

    ``save`` returns once the state is snapshotted; writing, voting and committing run on a
    background thread. How snapshots are held is a :class:`mpickpt.Snapshots`
    (``max_in_flight``, ``if_busy="wait"`` or ``"skip"``, ``pinned_budget``,
    ``device_staging``). The CPU tensors only an optimizer in the state changes are copied
    while forward and backward run; its ``step()`` waits for that copy.

    ``preemption`` (a bool, or a :class:`mpickpt.Preemption` with a ``deadline`` and
    ``requeue``) installs handlers for SIGUSR2 and SIGTERM that only raise a flag, which
    :meth:`should_exit` agrees on; under Slurm the deadline is the job's end time and the job
    is requeued once after the emergency save.

    Sharding (see :mod:`mpickpt.sharding`): a ``DTensor`` (FSDP2, tensor parallel) or a
    :class:`mpickpt.Piece` in the state is saved as a piece of its global tensor; ``replicated``
    names key paths (``"model"``, ``"optim"``) whose plain tensors every rank holds alike (DDP).
    Identical pieces are written once, by one of their holders. A checkpoint restores on any
    number of ranks and any sharding (``world_change="reshard"``): each rank reads the stored
    pieces that overlap its own; rank ``r`` takes the per-rank state of stored rank ``r mod N``.
    ``world_change="fail"`` refuses another number of ranks instead.

    The node-local level (``local``: a :class:`mpickpt.Local`, or a path for ``Local(path)``;
    a directory on each node, ``/dev/shm/...`` for memory or an NVMe scratch directory): every
    save goes there, committed on every node with the same vote, protected from the loss of a
    node by ``Local.redundancy`` (``"partner"`` or ``"xor"``), and every ``persist_every``-th
    one, the emergency one and, at ``close()``, the newest one are then drained to ROOT.
    ``restore`` takes the newest step every rank can get from the fastest level: its own local
    shard, else one rebuilt from redundancy over MPI, else ROOT. Nodes are the ranks that share
    memory, or what ``$MPICKPT_NODE`` names (tests simulate nodes with it).

    ``encoding`` (ROOT only, not with ``local``): a :class:`mpickpt.Encoding` with
    ``incremental=N`` (unchanged tensors referred to, not written again; every ``N``-th save is
    full), ``frozen`` (key paths referred to without copying or hashing) and ``compression``
    (zstd per checksum block, as HDF5's Zstd filter reads it; needs ``pip install
    'mpickpt[compress]'``).

    ``files``: a :class:`mpickpt.Files`, or ``"per-rank"`` / ``"per-node"`` for
    ``Files(per=...)``: one file per node (ROOT only, for parallel file systems whose metadata
    servers are the limit), the ``fanout`` of sub-directories, the ``index`` parts, and every
    shard's ``alignment`` and ``checksum_block``.

    The flat keywords of earlier releases (``redundancy=``, ``fanout=``, ``keep_every=``,
    ``incremental=``, ``max_in_flight=``, ``deadline=`` and the others each group took in)
    still work, with a DeprecationWarning that shows the group to write instead.
    """


    @_agreed
    def __init__(
        self,
        root: str | os.PathLike[str],
        comm: Any = None,
        keep: int | Retention | None = None,
        *,
        timeout: float | None = None,
        io_threads: int = 8,
        on_error: str = "warn",
        replicated: tuple[str, ...] | list[str] = (),
        world_change: str = "reshard",
        local: str | os.PathLike[str] | Local | None = None,
        files: str | Files = "per-rank",
        encoding: Encoding | None = None,
        snapshots: Snapshots | None = None,
        preemption: bool | Preemption = True,
        **deprecated: Any,
    ) -> None:
        o = gather(local, files, keep, encoding, snapshots, preemption, deprecated,
                   stacklevel=3)  # the caller, behind _agreed and __init__
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        if world_change not in ("reshard", "fail"):
            raise ValueError(f"world_change must be 'reshard' or 'fail', not {world_change!r}")
        pick = o.encoding.chooser()
        if pick is not None:
            codec.require()
        self.root = os.path.abspath(os.fspath(root))
        self.retention, self.keep, self.io_threads = o.retention.policy(), o.retention.keep, \
            io_threads
        self.replicated = tuple(p.strip("/") for p in replicated)
        self.world_change, self.on_error = world_change, on_error
        self._proto = Protocol(comm, timeout)
        self.rank, self.world_size = self._proto.rank, self._proto.size
        self.log = log.setup(self.rank)
        self.pinned_budget = o.snapshots.budget()
        self._pool = HostPool(self.pinned_budget // self._proto.local_size(),
                              o.snapshots.max_in_flight)
        self._capture = Capture(self._pool, o.snapshots.device_staging, self.replicated,
                                self.rank, self.world_size, self.log,
                                skip=o.snapshots.if_busy == "skip")
        self._exit_vote = self._proto.exit_vote()
        self._watch(o.preemption)
        self.restore_info: RestoreInfo | None = None
        self._closed = False
        self.run_id: str = self._collective(lambda: uuid.uuid4().hex[:12], "init", root_only=True)
        # why ROOT cannot be used now (None: it can); fatal without a local level
        self._root_problem: str | None = self._collective(self._prepare_root, "init",
                                                          root_only=True)
        if self._root_problem is not None and o.local is None:
            raise CheckpointError(f"init failed: rank 0: {self._root_problem}")
        self._root_shared = False  # proved at the first save (a restore writes nothing to ROOT)
        self._local, self._recovery = self._open_local(o.local)
        self._local_checked = False
        layout = o.files
        options = ShardOptions(layout.alignment, layout.checksum_block, io_threads,
                               layout.index == "per-rank" or (layout.index == "auto"
                                                              and self.world_size > SPLIT_RANKS),
                               o.encoding.incremental, o.encoding.matcher(), pick,
                               layout.per_node, layout.fanout)
        self._pipeline = self._assemble(options, on_error == "raise",
                                        o.snapshots.if_busy == "skip")
        self._capture.tracker = self._pipeline.root.tracker
        _OPEN.add(self._pipeline)
        _hook_exit()

    def _watch(self, preemption: Preemption) -> None:
        """Install the preemption handlers; the deadline and requeue, from Slurm unless
        given."""
        self.preemption = preemption.signals
        if preemption.signals and not preempt.install():
            self.log.warning("preemption signals are not watched: Checkpointer was created "
                             "outside the main thread")
        self.deadline = preemption.deadline if preemption.deadline is not None \
            else slurm.job_end()
        self.requeue = preemption.requeue if preemption.requeue is not None \
            else slurm.requeues()
        self.preempted = False

    def _open_local(self, level: Local | None
                    ) -> tuple[LocalLevel | None, LocalRecovery | None]:
        """The node-local level and its recovery, when there is one (collective)."""
        if level is None:
            return None, None
        lv = open_level(self._proto, level, self.root, self.run_id, self.log, self._collective)
        if self._root_problem is not None and self.rank == 0:
            self.log.warning(
                "ROOT cannot be used: %s. Restore takes what the node-local level holds; "
                "saves are protected on the nodes, and their drains to ROOT fail (each one "
                "says so) until ROOT is back", self._root_problem)
        return lv, LocalRecovery(self._proto, lv, self.io_threads, self.log)

    def _assemble(self, options: ShardOptions, raise_on_error: bool, skip: bool) -> Pipeline:
        """The save pipeline: its stores (ROOT's; the node store first with a local level)
        and what they write with."""
        tracker = Tracker(self.root, options.incremental, options.frozen) \
            if options.incremental else None
        shards = RankShards(self.rank, self.world_size, options, tracker, self.log)
        root = RootStore(self._proto, self.root, self.run_id, shards,
                         Upkeep(self.root, self.run_id, self.retention, self.log), self.log,
                         node=self._node_files(options.fanout) if options.per_node else None)
        lv = self._local
        if lv is None:
            return Pipeline(self._proto, self.run_id, self._capture.snapshotter, root, root,
                            self.log, raise_on_error, skip=skip)
        return Pipeline(self._proto, self.run_id, self._capture.snapshotter,
                        NodeStore(self._proto, self.run_id, lv, shards, self.log), root,
                        self.log, raise_on_error, lv.persist_every, lv.drain_bandwidth, skip)

    def _node_files(self, fanout: int) -> NodeFiles:
        """This rank's node and its ranks, for files="per-node" (collective)."""
        with self._proto.fatal_timeouts(self.log):
            topo = Topology(tuple(self._proto.nodes(knobs.NODE.get())))
            node = topo.node_index(self.rank)
            team = self._proto.sub(node, topo.local_index(self.rank))
        return NodeFiles(team, node, len(topo.names), fanout)

    # -------------------------------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any], metadata: dict[str, Any] | None = None,
             *, drain: bool = False) -> SaveHandle:
        """Checkpoint ``state`` as ``step`` on every rank, all or nothing; collective.

        ``step`` is the number of training steps completed: ``restore`` returns it, and the loop
        resumes there. ``metadata`` (JSON values, see :mod:`mpickpt.save.metadata`) goes into the
        manifest. Returns once the state is snapshotted (the training thread's whole cost); the
        write, the vote and the commit go on in the background. A state or metadata mpickpt
        cannot save raises :class:`StateTreeError` or :class:`MetadataError` here, after every
        rank has aborted the save. With a local level, ``drain`` sends this one to ROOT too.
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self._pipeline.report_finished()
        # before the first save writes anything (a ROOT that was unusable at the start is not
        # written until a drain finds it back, and a drain commits only every rank's shard)
        if not self._root_shared and self._root_problem is None:
            shared_root.check(self._proto, self.root, self.run_id, self.log)
            self._root_shared = True
        request, user_error = self._capture.take(step, state, metadata)
        request.drain = drain
        if self._local is not None and not self._local_checked and user_error is None:
            user_error = self._check_local_room(request)
            self._local_checked = True
        handle = self._pipeline.submit(request)
        if user_error is not None:
            handle.outcome()  # the other ranks abort this save too
            handle.reported = True
            raise user_error
        return handle

    def _check_local_room(self, request: SaveRequest) -> CheckpointError | None:
        """At the first save (nothing in flight yet): can every node's local level hold the
        checkpoints it must keep? If not, the save aborts and every rank raises at once."""
        assert self._local is not None
        why = None
        if request.snapshot is not None:
            try:
                self._local.check_room(request.snapshot.nbytes, request.snapshot.count,
                                       self.rank)
            except LocalTierFull as e:
                why = str(e)
        with self._proto.fatal_timeouts(self.log):
            failed = self._proto.agree(why, "local-room")
        if failed is None:
            return None
        request.error = request.error or str(failed)
        return LocalTierFull(str(failed))

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate now the host (page-locked with CUDA) and device buffers that saving
        ``state`` needs, so that the first :meth:`save` stalls training no more than later ones.
        Call it before the training loop; it blocks for about as long as page-locking takes
        (seconds for gigabytes), which otherwise the first save's training steps would wait
        for, from whichever thread it ran. Not collective.
        """
        self._check_open()
        self._capture.prepare(state)

    def wait(self) -> list[SaveResult]:
        """Block until every save in flight is committed or aborted; their results."""
        return self._pipeline.wait()

    def wait_snapshot(self) -> None:
        """Block until the last snapshot no longer reads the state's tensors.

        Optimizer steps and forward passes of modules in the state wait for it by themselves
        (on the GPU); call this before changing a checkpointed tensor any other way.
        """
        self._capture.snapshotter.wait_snapshot()

    @property
    def drained(self) -> int | None:
        """With a local level: the last step this Checkpointer drained to ROOT (after
        :meth:`wait`, the drains that were due are done), or None."""
        return self._pipeline.drained

    @property
    def pinned_bytes(self) -> int:
        """Host buffer memory this rank holds for snapshots."""
        return self._pool.allocated_bytes

    # ----------------------------------------------------------------------------------- restore

    @_agreed
    def restore(self, state: dict[str, Any], step: int | None = None, *,
                upto: int | None = None) -> int | None:
        """Load the newest checkpoint that every rank can load (or ``step``; or the newest of a
        step no later than ``upto``) into ``state`` in place; return its step, or None when there
        is none. Collective.

        Details, including skipped checkpoints and the user metadata, are in ``restore_info``.
        """
        self._check_open()
        self.wait()
        if self._pipeline.root.tracker is not None:  # the state changes: the next save is full
            self._pipeline.root.tracker.forget()
        t0 = time.perf_counter()
        candidates, undo, unlisted = self._collective(self._list_root, "list", root_only=True)
        if unlisted is not None and self._recovery is None:
            raise CheckpointError(f"cannot list the checkpoints under ROOT: {unlisted}")
        if step is not None:
            candidates = [c for c in candidates if c[0] == step]
        if upto is not None:
            candidates = [c for c in candidates if c[0] <= upto]
        with self._proto.fatal_timeouts(self.log):
            local_steps = self._recovery.steps(undo) if self._recovery is not None else []
            if step is not None:
                local_steps = [s for s in local_steps if s == step]
            if upto is not None:
                local_steps = [s for s in local_steps if s <= upto]
        if step is not None and not candidates and not local_steps:
            raise CheckpointError(f"no checkpoint of step {step} under {self.root}"
                                  + (" or in the local level" if self._local else ""))
        with self._proto.fatal_timeouts(self.log):
            restorer = Restorer(self._proto, self._pool, self.io_threads, self.log,
                                self.replicated, self.world_change)
            info = restorer.run(state, candidates, explicit=step is not None,
                                local=self._recovery, local_steps=local_steps)
            info.total_bytes_read = self._proto.sum(info.bytes_read, "restored")
            info.total_network_bytes = self._proto.sum(info.network_bytes, "restored")
            if info.level == "local":
                info.total_fetched_bytes = self._proto.sum(info.fetched_bytes, "restored")
            info.root_bytes = info.total_bytes_read if info.level == "root" else 0
        info.seconds = time.perf_counter() - t0
        self.restore_info = info
        if info.step is None and unlisted is not None:
            raise CheckpointError(
                f"no step of the node-local level can be restored, and ROOT cannot be listed "
                f"({unlisted}): refusing to start afresh while ROOT may hold checkpoints; make "
                "ROOT readable, or give another ROOT for a fresh start")
        tracker = self._pipeline.root.tracker
        if tracker is not None and info.step is not None and restorer.manifest is not None \
                and info.level == "root" and info.world_size == self.world_size:
            tracker.resume(info.step, restorer.manifest.ranks[self.rank])
        if self.rank == 0:
            if info.step is None:
                self.log.info("no loadable checkpoint under %s: fresh start%s", self.root,
                              f" ({len(info.skipped)} skipped)" if info.skipped else "")
            else:
                where = info.path if info.level == "root" else "the local level"
                self.log.info("restored step %d from %s in %.2f s: %s read by %d rank(s), "
                              "%s%s", info.step, where, info.seconds,
                              log.human_bytes(info.total_bytes_read), self.world_size,
                              log.human_rate(info.total_bytes_read / max(info.seconds, 1e-9)),
                              f", {log.human_bytes(info.total_network_bytes)} rebuilt over "
                              "the network" if info.total_network_bytes else "")
                if info.total_fetched_bytes:
                    self.log.info("step %d: %s of shards of other nodes sent over the network "
                                  "(replicated or resharded tensors)", info.step,
                                  log.human_bytes(info.total_fetched_bytes))
        return info.step

    # -------------------------------------------------------------------------------- preemption

    def should_exit(self, step: int | None = None,
                    state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, *,
                    exit: bool = True) -> bool:
        """Call once per step on every rank: whether a preemption signal reached any rank.

        Costs one non-blocking allreduce per call (see :class:`mpickpt.mpi.protocol.ExitVote`); all
        ranks see the answer at the same call. When it is yes: the saves in flight finish, then
        ``state`` is saved as ``step`` and committed (unless that step is already committed or
        the deadline leaves too little time), rank 0 requeues the job under Slurm, and, with
        ``exit``, the Checkpointer is closed and ``SystemExit(EXIT_PREEMPTED)`` (3) is raised on
        every rank; without it, True is returned. ``state`` may be a function that returns the
        state, called only then (a framework's checkpoint dict, costly to build every step).
        """
        self._check_open()
        with self._proto.fatal_timeouts(self.log):  # a rank stopped calling: dead or hung
            flag = preempt.kind() if self.preemption else preempt.NONE
            vote = self._exit_vote.poll(flag, self.rank, step)
        if vote is None:
            return False
        kind, who = vote
        self.preempted = True
        if self.rank == 0:
            what = "preemption signal" if kind == preempt.PREEMPT else "SIGTERM"
            self.log.warning("%s on rank %d: checkpointing step %s and exiting", what, who, step)
        self.wait()
        if step is not None and state is not None:
            self._emergency_save(step, state() if callable(state) else state)
        # not for SIGTERM alone: that is also how scancel ends a job
        if kind == preempt.PREEMPT and self.requeue and self.rank == 0:
            slurm.requeue(self.log)
        if exit:
            self.close()
            raise SystemExit(EXIT_PREEMPTED)
        return True

    def _emergency_save(self, step: int, state: dict[str, Any]) -> None:
        last = self._pipeline.last
        if last is not None and last.step == step:
            self._pipeline.scavenge()  # committed; with a local level, make sure ROOT has it
            self._pipeline.wait()
            return
        need = None
        if last is not None:
            s = last.stats
            need = 1.25 * (s.get("stall_s", 0) + s.get("persist_s", 0) + s.get("commit_s", 0)
                           + s.get("protect_s", 0) + s.get("drain_s", 0))
        left = None if self.deadline is None else self.deadline - time.time()
        # every rank decides from the same inputs (rank 0's figures), so all save or none does
        with self._proto.fatal_timeouts(self.log):
            need, left = self._proto.bcast((need, left), "emergency")
        if need is not None and left is not None and need > left:
            if self.rank == 0:
                self.log.error("no time for the emergency checkpoint of step %d: it needs about "
                               "%.0f s, the job ends in %.0f s; the job will resume from step %s",
                               step, need, left, last.step if last else None)
            return
        result = self.save(step, state, drain=True).wait()
        self._pipeline.wait()  # and its drain to ROOT, with a local level
        if self.rank == 0 and result.committed:
            if self._local is None or self._pipeline.drained == step:
                self.log.info("emergency checkpoint of step %d committed", step)
            else:
                self.log.warning("emergency checkpoint of step %d committed on the nodes only: "
                                 "its drain to ROOT failed", step)

    # ------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Wait for the saves in flight, meet the other ranks and release the private
        communicators. Collective: a rank that never gets here (hung after a commit, say) makes
        the others miss the deadline of the 'close' barrier and abort the job, rather than hang
        in MPI_Finalize."""
        if not self._closed:
            self._pipeline.scavenge()  # the newest local checkpoint reaches ROOT
            self.wait()
            self._pipeline.shutdown()
            if self._local is not None and self._local.exchange is not None:
                self._local.exchange.free()
            if self._pipeline.root.node is not None:
                self._pipeline.root.node.proto.free()
            self._closed = True
            _OPEN.discard(self._pipeline)
            with self._proto.fatal_timeouts(self.log):
                self._exit_vote.free()
                self._proto.barrier("close")
            self._proto.free()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    def _collective(self, fn: Callable[[], T], phase: str, root_only: bool = False) -> T:
        """Run ``fn`` (on rank 0 only, or on all ranks) and raise on every rank if it failed
        anywhere; with ``root_only`` every rank gets rank 0's result."""
        value, err = None, None
        if self.rank == 0 or not root_only:
            try:
                value = fn()
            except Exception as e:
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        with self._proto.fatal_timeouts(self.log):
            if root_only:
                value, err = self._proto.bcast((value, err), phase)
            elif failed := self._proto.agree(err, phase, report=phase):
                raise CheckpointError(str(failed))
        if err is not None:
            raise CheckpointError(f"{phase} failed: {err}")
        return value  # type: ignore[return-value]

    def _list_root(self) -> tuple[list[tuple[int, str]], Rollback | None, str | None]:
        """(ROOT's committed steps, its rollback in effect, why ROOT cannot be listed); on
        rank 0. With a local level, an unreadable ROOT is logged and restore goes on without
        it."""
        try:
            candidates = rootdir.committed(self.root, require_manifest=False)
        except OSError as e:
            why = f"{self.root}: {type(e).__name__}: {e.strerror or e}"
            if self._local is not None:
                self.log.warning("cannot list the checkpoints under ROOT (%s): restoring from "
                                 "the node-local level alone (a rollback recorded in ROOT "
                                 "cannot be seen either)", why)
            return [], None, why
        return candidates, rollback.active(self.root), None

    def _prepare_root(self) -> str | None:
        """Create ROOT and remove what earlier runs left half done; why ROOT cannot be used,
        or None."""
        try:
            rootdir.make_dirs(self.root)
            doomed = rootdir.leftovers(self.root, self.run_id)
        except OSError as e:
            return f"{self.root}: {type(e).__name__}: {e.strerror or e}"
        for path in doomed:
            self.log.info("removing %s, left by an earlier run that did not finish its save", path)
            try:
                rootdir.remove(path, self.run_id)
            except OSError as e:  # e.g. a read-only ROOT: restore must still work
                self.log.warning("could not remove %s (%s); it is never loaded, and removed at "
                                 "a later start", path, log.os_error(e, path))
        return None


def finish_saves(why: str) -> bool:
    """Wait for the saves in flight of every Checkpointer not yet closed; whether all of them
    committed. Called at interpreter exit (and by :mod:`mpickpt.run` when the program returns):
    a forgotten ``close()`` must not drop the last checkpoint."""
    ok = True
    for pipeline in list(_OPEN):
        ok = pipeline.finish(why) and ok
    return ok


def _at_exit() -> None:
    """Before Python joins its threads and stops the thread pools: finish the saves in flight;
    if one cannot commit, the process must not exit 0 as if all were saved."""
    if not finish_saves("the program ended without Checkpointer.close()"):
        sys.stderr.write(f"[mpickpt] the last checkpoint was lost; exiting with code "
                         f"{EXIT_FAILED}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)


def _hook_exit() -> None:
    """Run :func:`_at_exit` at interpreter exit, before ``concurrent.futures`` refuses new work
    (its own hook, registered earlier, runs later: they run in reverse order)."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_at_exit)
        _EXIT_HOOKED = True
