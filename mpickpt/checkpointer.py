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
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from . import assembly, background, log, preempt, slurm
from .errors import CheckpointError, LocalTierFull, install_hook, mark_agreed
from .exitcodes import EXIT_FAILED, EXIT_PREEMPTED
from .format import codec, rootstart
from .mpi.exitvote import ExitVote
from .mpi.protocol import Protocol, world_rank
from .options import (
    Encoding,
    Files,
    Local,
    Preemption,
    Retention,
    Snapshots,
    choose,
    gather,
)
from .restore import coordinate
from .restore.restorer import RestoreInfo
from .save import shared_root
from .save.capture import Capture
from .save.pinned_pool import HostPool
from .save.pipeline import Pipeline
from .save.request import SaveHandle, SaveResult
from .save.shards import ShardOptions

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


def step_numbers(**given: Any) -> None:
    """Refuse what is not a step number (an int >= 0) or None, naming the keyword."""
    for name, value in given.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise ValueError(f"restore({name}=...) takes a step number (an int >= 0) or None, "
                             f"not {value!r}")


class Checkpointer:
    """Save and restore consistent global checkpoints of every rank's state under ``root``.

    Collective over ``comm`` (the job, over MPI or gloo, by default): all ranks construct it,
    call ``save`` with the same steps and ``restore`` together. ``save`` returns once the state is
    snapshotted; writing, voting and committing run on a background thread, all or nothing on
    every rank. A failed save is reported on every rank and training goes on
    (``on_error="warn"``), or raises :class:`SaveAborted` from ``wait()`` and from the next
    ``save()`` (``on_error="raise"``). Collectives that miss ``timeout`` seconds abort the job;
    ``io_threads`` write and read each rank's shard. ``replicated`` names key paths whose plain
    tensors every rank holds alike (DDP); a ``DTensor`` or :class:`mpickpt.Piece` is saved as a
    piece of its global tensor, and a checkpoint restores on any number of ranks
    (``world_change="reshard"``; ``"fail"`` refuses another number).

    The other options come in groups, each a small object that checks itself (see
    ``docs/using.md``): ``keep`` (:class:`mpickpt.Retention`, or a number), ``local``
    (:class:`mpickpt.Local`, or a path: the node-local level, protected across nodes and
    drained to ROOT), ``files`` (:class:`mpickpt.Files`: a file per rank or per node, fanout,
    index parts, alignment, checksum block), ``encoding`` (:class:`mpickpt.Encoding`:
    incremental, frozen, compression; ROOT only), ``snapshots`` (:class:`mpickpt.Snapshots`:
    how many in flight, wait or skip, the pinned budget, device staging) and ``preemption``
    (:class:`mpickpt.Preemption`, or a bool: signals, deadline, requeue). The flat keywords of
    earlier releases still work, with a DeprecationWarning that shows the group to write.
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
        choose("on_error", on_error, ("warn", "raise"))
        choose("world_change", world_change, ("reshard", "fail"))
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
        background.warn_one_cpu(self.log, io_threads, self.rank)
        self.pinned_budget = o.snapshots.budget()
        self._pool = HostPool(self.pinned_budget // self._proto.local_size(),
                              o.snapshots.max_in_flight)
        self._capture = Capture(self._pool, o.snapshots.device_staging, self.replicated,
                                self.rank, self.world_size, self.log,
                                skip=o.snapshots.if_busy == "skip", share=o.files.min_write_share)
        self._watch(o.preemption)  # (before the exit vote: a rank that votes watches the signals)
        self._exit_vote = ExitVote(self._proto, functools.partial(slurm.say_ready, self.log)
                                   if self.preemption and self.rank == 0 else None)
        self.restore_info: RestoreInfo | None = None
        self._closed = False
        self.run_id: str = self._proto.everywhere(lambda: uuid.uuid4().hex[:12], "init",
                                                  self.log, root_only=True)
        # why ROOT cannot be used now (None: it can); fatal without a local level
        self._root_problem: str | None = self._proto.everywhere(
            lambda: rootstart.prepare(self.root, self.run_id, self.log), "init", self.log,
            root_only=True)
        if self._root_problem is not None and o.local is None:
            raise CheckpointError(f"init failed: rank 0: {self._root_problem}")
        self._root_shared = False  # proved at the first save (a restore writes nothing to ROOT)
        self._local, self._recovery = assembly.local_level(
            self._proto, o, self.root, self.run_id, self._root_problem, self.io_threads,
            self.log)
        self._local_checked = False
        layout = o.files
        options = ShardOptions(layout.alignment, layout.checksum_block, io_threads,
                               layout.index == "per-rank" or (layout.index == "auto"
                                                              and self.world_size > SPLIT_RANKS),
                               o.encoding.incremental, o.encoding.matcher(), pick,
                               layout.per_node, layout.fanout)
        self._pipeline = assembly.pipeline(
            self._proto, self.root, self.run_id, self._capture.snapshotter, options,
            self.retention, self._local, self.log, raise_on_error=on_error == "raise",
            skip=o.snapshots.if_busy == "skip")
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

    def save(self, step: int, state: dict[str, Any], metadata: dict[str, Any] | None = None,
             *, drain: bool = False) -> SaveHandle:
        """Checkpoint ``state`` as ``step`` on every rank, all or nothing; collective.

        ``step`` is the number of training steps completed: ``restore`` returns it, and the loop
        resumes there. ``metadata`` (JSON values, see :mod:`mpickpt.save.metadata`) goes into the
        manifest. Returns once the state is snapshotted (the training thread's whole cost); the
        write, the vote and the commit go on in the background. A state or metadata mpickpt
        cannot save raises :class:`StateTreeError` or :class:`MetadataError` here, after every
        rank aborted the save. With a local level, ``drain`` sends this one to ROOT too."""
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self._pipeline.report_finished()
        # before the first save writes anything (ROOT unusable at the start: not written until
        # a drain finds it back; a drain commits only every rank's shard)
        if not self._root_shared and self._root_problem is None:
            self._pipeline.settle()  # a restore's write-back: its collectives, not beside ours
            shared_root.check(self._proto, self.root, self.run_id, self.log)
            self._root_shared = True
        request, user_error = self._capture.take(step, state, metadata)
        request.drain = drain
        if self._local is not None and not self._local_checked and user_error is None:
            self._pipeline.settle()
            full = self._local.agree_room(self._proto, request, self.log)
            if full is not None:  # the save aborts, and every rank raises at once
                request.error = request.error or full
                user_error = LocalTierFull(full)
            self._local_checked = True
        handle = self._pipeline.submit(request)
        if user_error is not None:
            handle.outcome()  # the other ranks abort this save too
            handle.reported = True
            raise user_error
        return handle

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
        """Block until the last snapshot no longer reads the state's tensors. Optimizer steps
        and forward passes of modules in the state wait for it by themselves (on the GPU), as
        the current stream does at once for CUDA tensors none guards; call this before changing
        a checkpointed tensor any other way (another stream, say)."""
        self._capture.snapshotter.wait_snapshot()

    @property
    def drained(self) -> int | None:
        """With a local level: the last step this Checkpointer drained to ROOT (after
        :meth:`wait`, the drains that were due are done), or None."""
        return self._pipeline.drained

    @property
    def pinned_bytes(self) -> int:
        """Host buffer memory this rank holds for snapshots (page-locked or not: pinned_pool)."""
        return self._pool.allocated_bytes

    # ----------------------------------------------------------------------------------- restore

    @_agreed
    def restore(self, state: dict[str, Any], step: int | None = None, *,
                upto: int | None = None) -> int | None:
        """Load the newest checkpoint that every rank can load (or ``step``; or the newest of a
        step no later than ``upto``) into ``state`` in place; return its step, or None when there
        is none. Collective. Details (skipped checkpoints, user metadata): ``restore_info``.
        """
        self._check_open()
        step_numbers(step=step, upto=upto)
        self.wait()
        if self._pipeline.root.tracker is not None:  # the state changes: the next save is full
            self._pipeline.root.tracker.forget()
        with self._proto.brisk():  # (the job waits for the restore's every collective)
            listed = self._proto.everywhere(
                lambda: rootstart.listing(self.root, self.log, self._local is not None),
                "list", self.log, root_only=True)
            info, manifest = coordinate.restore(
                self._proto, self._pool, state, self.root, listed, self._recovery, self.log,
                step=step, upto=upto, io_threads=self.io_threads, replicated=self.replicated,
                share=self._capture.share, world_change=self.world_change)
        self.restore_info = info
        if self._recovery is not None and self._recovery.pending:  # lost shards' files go
            self._pipeline.later(self._recovery.write_back)  # back to their nodes, behind it
        if info.step is None and listed[2] is not None:
            raise CheckpointError(
                f"no step of the node-local level can be restored, and ROOT cannot be listed "
                f"({listed[2]}): refusing to start afresh while ROOT may hold checkpoints; make "
                "ROOT readable, or give another ROOT for a fresh start")
        if (tracker := self._pipeline.root.tracker) is not None and info.level == "root" and \
                None not in (info.step, manifest) and info.world_size == self.world_size:
            tracker.resume(info.step, manifest.ranks[self.rank])
        return info.step

    # -------------------------------------------------------------------------------- preemption

    def should_exit(self, step: int | None = None,
                    state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, *,
                    exit: bool = True) -> bool:
        """Call once per step on every rank: whether a preemption signal reached any rank.

        Costs one non-blocking allreduce per call (see :class:`mpickpt.mpi.exitvote.ExitVote`); all
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
        if not self._pipeline.time_for(step, self.deadline):
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
        """Wait for the saves in flight, meet the other ranks, release the communicators and
        buffers. Collective: a rank that never gets here (hung after a commit, say) makes the
        others miss the 'close' barrier's deadline and abort the job, not hang in MPI_Finalize."""
        if not self._closed:
            self._pipeline.scavenge()  # the newest local checkpoint reaches ROOT
            self.wait()
            self._pipeline.shutdown()
            self._pool.close()  # its page-locked buffers unlocked before they are freed
            if self._local is not None:  # the level's mapped files let go
                self._local.close()
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

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")


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
