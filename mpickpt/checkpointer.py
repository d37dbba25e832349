"""The Checkpointer: consistent global checkpoints by two-phase commit, and coordinated restore.

save: the training thread only snapshots the state into a reusable host buffer (asynchronous for
CUDA tensors, see :mod:`mpickpt.snapshot`) and returns a handle; a background thread then writes
the rank's shard into ``step-XXXXXXXX.partial-<run>/`` and fsyncs it (prepare);
an allreduce MIN of success flags decides (vote); rank 0 then writes MANIFEST.json (temp, fsync,
rename), renames the directory to ``step-XXXXXXXX`` and fsyncs ROOT (commit), and tells every rank.
If any rank failed, every rank learns which and why, the partial directory is removed, and the
older checkpoints stay as they were (abort).

restore: rank 0 lists the checkpoints newest first, and :mod:`mpickpt.restore` loads the newest
one that every rank can load.

should_exit: preemption signals agreed across ranks, then an emergency save and requeue.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from . import faults, layout, log, preempt, retention, sharding, state_tree
from . import metadata as user_metadata
from .checksum import DEFAULT_BLOCK
from .errors import (
    CheckpointError,
    CollectiveTimeout,
    ManifestError,
    MetadataError,
    RootNotSharedError,
    SaveAborted,
    StateTreeError,
)
from .exitcodes import EXIT_COLLECTIVE_TIMEOUT, EXIT_FAILED, EXIT_PREEMPTED
from .manifest import NAME as MANIFEST
from .manifest import Manifest, RankEntry, read_bytes, shard_name
from .pinned_pool import HostPool
from .protocol import Protocol, ranks_text
from .restore import RestoreInfo, Restorer
from .shard import DEFAULT_ALIGNMENT, ShardWriter, TensorRecord
from .snapshot import Snapshot, Snapshotter

T = TypeVar("T")

# ROOT/stats.jsonl grows by a line (about 400 bytes) per commit; at this size it becomes
# stats.jsonl.1, replacing the older one, so that the two never hold much more than twice this
STATS_MAX_BYTES = 16 << 20

NOT_SHARED_ADVICE = (
    "every rank's shard must land in the same directory for a checkpoint to commit: give every "
    "rank the same path on a filesystem that all nodes mount (/scratch, $HOME, ...), not "
    "node-local storage such as /tmp, /dev/shm or $TMPDIR")

# Checkpointers not yet closed: their saves in flight are finished at interpreter exit
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_EXIT_HOOKED = False


def finish_saves(why: str) -> bool:
    """Wait for the saves in flight of every Checkpointer not yet closed; whether all of them
    committed. Called at interpreter exit (and by :mod:`mpickpt.run` when the program returns):
    a forgotten ``close()`` must not drop the last checkpoint."""
    ok = True
    for ckpt in list(_OPEN):
        ok = ckpt._finish_in_flight(why) and ok
    return ok


def _at_exit() -> None:
    """Before Python joins its threads and stops the thread pools: finish the saves in flight;
    if one cannot commit, the process must not exit 0 as if all were saved."""
    if not finish_saves("the program ended without Checkpointer.close()"):
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


def _collect(x: Any, out: list[Any]) -> None:
    """The optimizers and modules in a state (not inside modules)."""
    if isinstance(x, (torch.optim.Optimizer, torch.nn.Module)):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out)


@dataclass
class SaveResult:
    """What became of one save; the same on every rank."""

    step: int
    committed: bool
    path: str | None = None
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # as committed in the manifest


class SaveHandle:
    """Returned by :meth:`Checkpointer.save`: ``done()`` polls, ``wait()`` gives the
    :class:`SaveResult` once the checkpoint is committed or aborted on every rank."""

    def __init__(self, step: int, future: Future[SaveResult], raise_on_error: bool) -> None:
        self.step = step
        self._future = future
        self._raise = raise_on_error
        self.reported = False  # whether the caller has seen the outcome through wait()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        result = self._future.result(timeout)
        self.reported = True
        if self._raise and not result.committed:
            raise SaveAborted(f"checkpoint of step {result.step} aborted: {result.error}")
        return result


class Checkpointer:
    """Save and restore consistent global checkpoints of every rank's state under ``root``.

    Collective over ``comm`` (``MPI.COMM_WORLD`` by default): every rank constructs it, calls
    ``save`` with the same steps and ``restore`` together. ``keep`` committed checkpoints are kept
    (all when None). A failed save is reported on every rank and training goes on
    (``on_error="warn"``), or raises :class:`SaveAborted` from ``wait()`` and from the next
    ``save()`` (``on_error="raise"``).

    ``save`` returns once the state is snapshotted; writing, voting and committing run on a
    background thread. ``max_in_flight`` snapshots may be held at once: a save requested while
    that many are still persisting waits for the oldest. Snapshots live in host buffers allocated
    once and reused, page-locked when CUDA is present, within ``pinned_budget`` bytes per node
    (shared by the node's ranks; half the node's memory by default). ``device_staging`` lets a
    CUDA snapshot go through a GPU staging buffer when GPU memory allows, so the next optimizer
    step waits only for a device-to-device copy.

    ``preemption`` installs handlers for SIGUSR2 (``MPICKPT_SIGNAL`` names another) and SIGTERM
    that only raise a flag, which :meth:`should_exit` agrees on. ``deadline`` (Unix time; default
    ``$MPICKPT_DEADLINE`` or ``$SLURM_JOB_END_TIME``) is when the job will be killed: an emergency
    save that cannot finish before it is skipped, and the log says so. ``requeue`` (default: when
    ``$SLURM_JOB_ID`` is set and ``$MPICKPT_REQUEUE`` is not 0) makes rank 0 requeue the job
    with ``scontrol requeue`` once, after the emergency save, when the preemption signal came
    (SIGTERM alone checkpoints and exits but does not requeue: ``scancel`` sends it too).

    Sharding (see :mod:`mpickpt.sharding`): a ``DTensor`` (FSDP2, tensor parallel) or a
    :class:`mpickpt.Shard` in the state is saved as a piece of its global tensor; ``replicated``
    names key paths (``"model"``, ``"optim"``) whose plain tensors every rank holds alike (DDP).
    Identical pieces are written once, by one of their holders. A checkpoint restores on any
    number of ranks and any sharding (``world_change="reshard"``): each rank reads the stored
    pieces that overlap its own; rank ``r`` takes the per-rank state of stored rank ``r mod N``.
    ``world_change="fail"`` refuses another number of ranks instead.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        comm: Any = None,
        keep: int | None = None,
        *,
        timeout: float | None = None,
        io_threads: int = 8,
        alignment: int = DEFAULT_ALIGNMENT,
        checksum_block: int = DEFAULT_BLOCK,
        on_error: str = "warn",
        max_in_flight: int = 1,
        pinned_budget: int | None = None,
        device_staging: bool = True,
        preemption: bool = True,
        deadline: float | None = None,
        requeue: bool | None = None,
        replicated: tuple[str, ...] | list[str] = (),
        world_change: str = "reshard",
        keep_every: int | None = None,
        best: tuple[str, str] | None = None,
        keep_best: int = 0,
    ) -> None:
        if best is not None and not (isinstance(best, (tuple, list)) and len(best) == 2
                                     and isinstance(best[0], str)):
            raise ValueError(f"best must be (metadata key, 'min' or 'max'), not {best!r}")
        self.retention = retention.Policy(keep, keep_every, best[0] if best else None,
                                          best[1] if best else "min", keep_best)
        self.retention.check()
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', not {on_error!r}")
        if world_change not in ("reshard", "fail"):
            raise ValueError(f"world_change must be 'reshard' or 'fail', not {world_change!r}")
        self.replicated = tuple(p.strip("/") for p in replicated)
        self.world_change = world_change
        self.root = os.path.abspath(os.fspath(root))
        self.keep = keep
        self.io_threads = io_threads
        self.alignment = alignment
        self.block = checksum_block
        self.on_error = on_error
        self._proto = Protocol(comm, timeout)
        self.rank, self.world_size = self._proto.rank, self._proto.size
        self.log = log.setup(self.rank)
        if pinned_budget is None:
            pinned_budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        self.pinned_budget = pinned_budget
        self._pool = HostPool(pinned_budget // self._proto.local_size(), max_in_flight)
        self._snapshotter = Snapshotter(self._pool, device_staging)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-persist")
        self._pending: list[SaveHandle] = []
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._hook_lock = threading.Lock()
        self._exit_vote = self._proto.exit_vote()
        if preemption and not preempt.install():
            self.log.warning("preemption signals are not watched: Checkpointer was created "
                             "outside the main thread")
        if deadline is None:
            env = os.environ.get("MPICKPT_DEADLINE") or os.environ.get("SLURM_JOB_END_TIME")
            deadline = float(env) if env else None
        self.deadline = deadline
        if requeue is None:
            requeue = "SLURM_JOB_ID" in os.environ and os.environ.get("MPICKPT_REQUEUE") != "0"
        self.requeue = requeue
        self.preempted = False
        self._last: SaveResult | None = None  # the last committed save
        self._waits: list[float] = []  # rank 0: the seconds each save of a run of waits waited
        self._metadata: dict[int, dict[str, Any]] = {}  # rank 0: of committed steps, for retention
        self.run_id: str = self._collective(lambda: uuid.uuid4().hex[:12], "init", root_only=True)
        self.restore_info: RestoreInfo | None = None
        self._closed = False
        self._collective(self._prepare_root, "init", root_only=True)
        self._check_shared_root()
        _OPEN.add(self)
        _hook_exit()

    # ---------------------------------------------------------------------------------- plumbing

    def _collective(self, fn: Callable[[], T], phase: str, root_only: bool = False) -> T:
        """Run ``fn`` (on rank 0 only, or on all ranks) and raise on every rank if it failed
        anywhere; with ``root_only`` every rank gets rank 0's result."""
        value, err = None, None
        if self.rank == 0 or not root_only:
            try:
                value = fn()
            except Exception as e:
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        try:
            if root_only:
                value, err = self._proto.bcast((value, err), phase)
            elif not self._proto.all_ok(err is None, phase):
                raise CheckpointError("; ".join(filter(None, self._proto.allgather(err, phase))))
        except CollectiveTimeout as e:
            self._timed_out(e)
        if err is not None:
            raise CheckpointError(f"{phase} failed: {err}")
        return value  # type: ignore[return-value]

    def _timed_out(self, e: CollectiveTimeout) -> None:
        self.log.error("%s; aborting the job (exit code %d), the last committed checkpoint stays "
                       "loadable", e, EXIT_COLLECTIVE_TIMEOUT)
        self._proto.abort(EXIT_COLLECTIVE_TIMEOUT)

    def _prepare_root(self) -> None:
        layout.make_dirs(self.root)
        for path in layout.leftovers(self.root, self.run_id):
            self.log.info("removing %s, left by an earlier run that did not finish its save", path)
            try:
                layout.remove(path, self.run_id)
            except OSError as e:  # e.g. a read-only ROOT: restore must still work
                self.log.warning("could not remove %s (%s); it is never loaded, and removed at "
                                 "a later start", path, e)

    def _check_shared_root(self) -> None:
        """Prove that every rank sees ROOT as the same directory, or raise RootNotSharedError on
        every rank naming the ranks that do not: rank 0 writes a token there and every rank reads
        it back through its own path. A ROOT rank 0 cannot write (read-only, for a restore) is
        compared by its inode and its listing instead."""
        name = f".mpickpt-root-check-{self.run_id}"
        token: str | None = uuid.uuid4().hex
        listing = None
        if self.rank == 0:
            try:
                layout.atomic_write(os.path.join(self.root, name), token.encode())
            except OSError:
                token, listing = None, _fingerprint(self.root)
        token, listing, root0 = self._collective(lambda: (token, listing, self.root), "root",
                                                 root_only=True)
        why = None
        try:
            if token is not None:
                with open(os.path.join(self.root, name), "rb") as f:
                    if f.read() != token.encode():
                        why = "it holds another run's token"
            elif _fingerprint(self.root) != listing:
                why = (f"{self.root} is another directory than rank 0's (its inode or "
                       "entries differ)")
        except OSError as e:
            why = e.strerror or str(e)
        try:
            ok = self._proto.all_ok(why is None, "root")
            bad = [] if ok else self._proto.allgather(
                (self.rank, socket.gethostname(), self.root, why), "root-report")
        except CollectiveTimeout as e:
            self._timed_out(e)
            raise
        if self.rank == 0 and token is not None:
            with contextlib.suppress(OSError):  # a leftover is harmless, and never loaded
                os.unlink(os.path.join(self.root, name))
        if ok:
            return
        bad = [b for b in bad if b[3] is not None]
        hosts = ", ".join(sorted({h for _, h, _, _ in bad}))
        r, _, path, reason = bad[0]
        raise RootNotSharedError(
            f"ROOT {root0} (rank 0) is not one directory shared by every rank: "
            f"{ranks_text(b[0] for b in bad)} on {hosts} cannot read the file rank 0 wrote "
            f"there (rank {r}, {os.path.join(path, name)}: {reason}); {NOT_SHARED_ADVICE}")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    # -------------------------------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any], metadata: dict[str, Any] | None = None
             ) -> SaveHandle:
        """Checkpoint ``state`` as ``step`` on every rank, all or nothing; collective.

        ``step`` is the number of training steps completed: ``restore`` returns it, and the loop
        resumes there. ``metadata`` (JSON values, see :mod:`mpickpt.metadata`) goes into the
        manifest. Returns once the state is snapshotted (the training thread's whole cost); the
        write, the vote and the commit go on in the background. A state or metadata mpickpt
        cannot save raises :class:`StateTreeError` or :class:`MetadataError` here, after every
        rank has aborted the save.
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self._report_finished()
        t0 = time.perf_counter()
        snap, tree, err, user_error = None, None, None, None
        layouts: dict[str, sharding.Layout] = {}
        md: dict[str, Any] = {}
        try:
            faults.hit("before-snapshot", self.rank, step)
            md = user_metadata.check(metadata)
            tree, tensors, layouts = state_tree.flatten_layouts(
                state, self.replicated, self.world_size)
            self._keep_mine(tensors, layouts)
            self._hook(state)
            waits = self._pool.in_flight() >= self._pool.slots
            snap = self._snapshotter.take(tensors)
            self._log_wait(step, waits)
        except (StateTreeError, MetadataError) as e:
            err, user_error = str(e), e
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        stats: dict[str, float] = {"stall_s": time.perf_counter() - t0}
        if snap is not None:
            stats["snapshot_bytes"] = snap.nbytes
            stats["waited_for_buffer_s"] = self._pool.waited_s
        future = self._worker.submit(self._persist, step, snap, tree, layouts, err, md, stats)
        handle = SaveHandle(step, future, self.on_error == "raise")
        self._pending.append(handle)
        if user_error is not None:
            handle.wait()
            raise user_error
        return handle

    def _log_wait(self, step: int, waited: bool) -> None:
        """Rank 0 says once when saves start waiting for earlier ones, and once when they stop."""
        if self.rank != 0:
            return
        if waited:
            if not self._waits:
                self.log.info("save of step %d waits for an earlier save to finish persisting "
                              "(waited %.2f s, max_in_flight=%d): saves come faster than they "
                              "persist; the next waits are logged once they end", step,
                              self._pool.waited_s, self._pool.slots)
            self._waits.append(self._pool.waited_s)
        elif self._waits:
            self.log.info("saves no longer wait: %d in a row waited for an earlier one, %.2f s "
                          "in all", len(self._waits), sum(self._waits))
            self._waits = []

    def _keep_mine(self, tensors: dict[str, torch.Tensor],
                   layouts: dict[str, sharding.Layout]) -> None:
        """Drop from ``tensors`` the replicated pieces another holder writes (DDP: each rank
        writes about 1/N of the model). The pieces of each replica group are spread over its
        ranks by :func:`mpickpt.sharding.writers`, which every holder computes alike."""
        groups: dict[tuple[int, ...], list[tuple[str, int, tuple[int, ...]]]] = {}
        for name, lay in layouts.items():
            if lay.holders is not None and len(lay.holders) > 1:
                t = tensors[name]
                groups.setdefault(lay.holders, []).append(
                    (name, t.numel() * t.element_size(), lay.holders))
        for pieces in groups.values():
            for name, rank in sharding.writers(pieces).items():
                if rank != self.rank:
                    del tensors[name]

    def _persist(self, step: int, snap: Snapshot | None, tree: dict[str, Any] | None,
                 layouts: dict[str, sharding.Layout], err: str | None,
                 metadata: dict[str, Any], stats: dict[str, float]) -> SaveResult:
        """Background thread: write, fsync, vote, commit (or abort), retention."""
        t0 = time.perf_counter()
        partial = os.path.join(self.root, layout.partial_name(step, self.run_id))
        entry = None
        try:
            if snap is not None and tree is not None:
                snap.wait()
                stats["copy_s"] = snap.copy_s or stats["stall_s"]
                layout.make_dirs(partial)
                entry = self._write_shard(partial, step, tree, snap.tensors, layouts, stats)
                stats["persist_s"] = time.perf_counter() - t0
                stats["persist_GBps"] = entry.bytes / max(stats["persist_s"], 1e-9) / 1e9
                faults.hit("after-fsync-before-vote", self.rank, step)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        finally:
            if snap is not None:
                snap.drained.set()  # also when it failed before draining: staging is free again
                self._pool.release(snap.buffer)
        try:
            result = self._vote_and_commit(step, partial, entry, err, metadata, stats)
        except CollectiveTimeout as e:
            self._timed_out(e)
            raise
        if result.committed:
            try:
                self._after_commit(result)
            except Exception as e:  # the checkpoint is committed on every rank all the same
                self.log.error("checkpoint step %d is committed, but what follows the commit "
                               "failed on rank %d: %s: %s", step, self.rank, type(e).__name__, e)
        else:
            self.log.error("checkpoint of step %d aborted on all ranks: %s; the previous "
                           "checkpoints are untouched and training goes on", step, result.error)
        return result

    def _report_finished(self) -> None:
        """Forget finished saves; with on_error="raise", raise for a failure nobody waited for."""
        still, failed = [], None
        for h in self._pending:
            if not h.done():
                still.append(h)
            elif not h.reported and not h._future.result().committed:
                failed = failed or h
        self._pending = still
        if failed is not None and self.on_error == "raise":
            failed.wait()

    def wait(self) -> list[SaveResult]:
        """Block until every save in flight is committed or aborted; their results."""
        results = [h._future.result() for h in self._pending]
        self._report_finished()
        return results

    def wait_snapshot(self) -> None:
        """Block until the last snapshot no longer reads the state's tensors.

        Optimizer steps and forward passes of modules in the state wait for it by themselves
        (on the GPU); call this before changing a checkpointed tensor any other way.
        """
        self._snapshotter.wait_snapshot()

    def _hook(self, state: Any) -> None:
        """Make the optimizers and modules in ``state`` wait for the snapshot before they change
        the tensors it copies: a GPU-side stream wait, nothing on the CPU."""
        if not torch.cuda.is_available():
            return
        fence = self._snapshotter.fence
        found: list[Any] = []
        _collect(state, found)
        with self._hook_lock:
            for obj in found:
                if obj in self._hooked:
                    continue
                if isinstance(obj, torch.optim.Optimizer):
                    obj.register_step_pre_hook(lambda *_: fence())
                else:
                    obj.register_forward_pre_hook(lambda *_: fence())
                self._hooked.add(obj)

    def should_exit(self, step: int | None = None, state: dict[str, Any] | None = None, *,
                    exit: bool = True) -> bool:
        """Call once per step on every rank: whether a preemption signal reached any rank.

        Costs one non-blocking allreduce per call (see :class:`mpickpt.protocol.ExitVote`); all
        ranks see the answer at the same call. When it is yes: the saves in flight finish, then
        ``state`` is saved as ``step`` and committed (unless that step is already committed or
        the deadline leaves too little time), rank 0 requeues the job under Slurm, and, with
        ``exit``, the Checkpointer is closed and ``SystemExit(EXIT_PREEMPTED)`` (3) is raised on
        every rank; without it, True is returned.
        """
        self._check_open()
        try:
            vote = self._exit_vote.poll(preempt.kind(), self.rank, step)
        except CollectiveTimeout as e:  # a rank stopped calling: dead or hung
            self._timed_out(e)
            raise
        if vote is None:
            return False
        kind, who = vote
        self.preempted = True
        if self.rank == 0:
            what = "preemption signal" if kind == preempt.PREEMPT else "SIGTERM"
            self.log.warning("%s on rank %d: checkpointing step %s and exiting", what, who, step)
        self.wait()
        if step is not None and state is not None:
            self._emergency_save(step, state)
        if kind == preempt.PREEMPT:
            self._requeue()  # not for SIGTERM alone: that is also how scancel ends a job
        if exit:
            self.close()
            raise SystemExit(EXIT_PREEMPTED)
        return True

    def _emergency_save(self, step: int, state: dict[str, Any]) -> None:
        if self._last is not None and self._last.step == step:
            return  # already committed
        need = None
        if self._last is not None:
            s = self._last.stats
            need = 1.25 * (s.get("stall_s", 0) + s.get("persist_s", 0) + s.get("commit_s", 0))
        left = None if self.deadline is None else self.deadline - time.time()
        # every rank decides from the same inputs (rank 0's figures), so all save or none does
        try:
            need, left = self._proto.bcast((need, left), "emergency")
        except CollectiveTimeout as e:
            self._timed_out(e)
            raise
        if need is not None and left is not None and need > left:
            if self.rank == 0:
                self.log.error("no time for the emergency checkpoint of step %d: it needs about "
                               "%.0f s, the job ends in %.0f s; the job will resume from step %s",
                               step, need, left, self._last.step if self._last else None)
            return
        result = self.save(step, state).wait()
        if self.rank == 0 and result.committed:
            self.log.warning("emergency checkpoint of step %d committed", step)

    def _requeue(self) -> None:
        if not self.requeue or self.rank != 0:
            return
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            return
        p = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if p.returncode == 0:
            self.log.warning("requeued Slurm job %s", job)
        else:
            self.log.error("scontrol requeue %s failed (exit %d): %s", job, p.returncode,
                           p.stderr.strip())

    @property
    def pinned_bytes(self) -> int:
        """Host buffer memory this rank holds for snapshots."""
        return self._pool.allocated_bytes

    def _write_shard(self, partial: str, step: int, tree: dict[str, Any],
                     host: dict[str, Any], layouts: dict[str, sharding.Layout],
                     stats: dict[str, float]) -> RankEntry:
        path = os.path.join(partial, shard_name(self.rank))
        t0 = time.perf_counter()
        writer = ShardWriter(
            path, host,
            {"rank": self.rank, "step": step, "world_size": self.world_size,
             "tree": json.dumps(tree, allow_nan=False)},
            alignment=self.alignment,
        )
        for r in writer.records:
            if r.name in layouts:
                r.global_shape = list(layouts[r.name].global_shape)
                r.offsets = list(layouts[r.name].offsets)
        try:
            t1 = time.perf_counter()
            writer.write(host, block=self.block, threads=self.io_threads,
                         on_block=lambda: faults.hit("mid-write", self.rank, step))
            t2 = time.perf_counter()
            size = writer.seal()
            stats.update(layout_s=t1 - t0, data_s=t2 - t1, seal_s=time.perf_counter() - t2)
        except OSError as e:
            writer.close()
            if e.filename is None:  # pwrite and fsync name no file: say which
                raise OSError(e.errno, e.strerror, path) from e
            raise
        except BaseException:
            writer.close()
            raise
        return RankEntry(self.rank, shard_name(self.rank), size, tree, writer.records)

    def _vote_and_commit(self, step: int, partial: str, entry: RankEntry | None,
                         err: str | None, metadata: dict[str, Any],
                         stats: dict[str, float]) -> SaveResult:
        if not self._proto.all_ok(err is None, "vote"):
            reasons = self._proto.allgather(err, "abort")
            why = "; ".join(f"rank {r}: {m}" for r, m in enumerate(reasons) if m)
            if self.rank == 0:
                self._discard(partial)
            return SaveResult(step, False, error=why, stats=stats)
        payload: dict[str, Any] | None = None
        try:
            if self.rank != 0:  # voted yes; rank 0 cannot write the manifest without its entry
                faults.hit("after-vote-before-manifest", self.rank, step)
            payload = asdict(entry) if entry else None
        except Exception as e:  # rank 0 aborts the commit, naming this rank
            payload = {"error": f"rank {self.rank}: {type(e).__name__}: {e}"}
        entries = self._proto.gather(payload, "gather")
        outcome: tuple[str | None, str | None, dict[str, Any]] = (None, None, {})
        if self.rank == 0:
            t = time.perf_counter()
            try:
                faults.hit("after-vote-before-manifest", 0, step)
                failed = [e["error"] for e in entries or [] if e and "error" in e]
                if failed:
                    raise CheckpointError("; ".join(failed))
                ranks = [RankEntry(**{**e, "tensors": [TensorRecord(**r) for r in e["tensors"]]})
                         for e in entries or []]
                _check_pieces(ranks)
                _check_shards(partial, ranks)
                metadata = user_metadata.resolve(metadata)
                manifest = Manifest(step, self.world_size, self.run_id, ranks, metadata,
                                    checksum_block=self.block)
                outcome = (self._commit(partial, manifest), None, metadata)
                stats["commit_s"] = time.perf_counter() - t
                stats["bytes"] = manifest.total_bytes
            except Exception as e:
                outcome = (None, f"rank 0: commit failed: {type(e).__name__}: {e}", {})
                self._discard(partial)
        else:  # rank 0 writes the manifest and commits while this rank waits for the outcome
            try:
                faults.hit("mid-manifest-write", self.rank, step)
            except Exception as e:  # rank 0 decides alone now: wait for its outcome
                self.log.error("rank %d: %s: %s while rank 0 commits step %d", self.rank,
                               type(e).__name__, e, step)
        path, error, metadata = self._proto.bcast(outcome, "commit")
        return SaveResult(step, error is None, path=path, error=error, stats=stats,
                          metadata=metadata)

    def _commit(self, partial: str, manifest: Manifest) -> str:
        """Publish: manifest into the partial directory, then the directory into place."""
        layout.atomic_write(
            os.path.join(partial, MANIFEST), manifest.to_json().encode(),
            on_half=lambda: faults.hit("mid-manifest-write", 0, manifest.step),
        )
        final = os.path.join(self.root, layout.step_name(manifest.step))
        if os.path.lexists(final):  # the same step saved again (a rerun after a restore)
            self.log.warning(
                "step %d was already committed; this save replaces it. The number saved is the "
                "count of training steps done: a loop that resumes at the restored number and "
                "saves after training a step should save step + 1", manifest.step)
            layout.remove(final, self.run_id)
        os.rename(partial, final)
        layout.fsync_path(self.root)
        return final

    def _discard(self, partial: str) -> None:
        try:
            if os.path.lexists(partial):
                layout.remove(partial, self.run_id)
        except OSError as e:
            self.log.warning("could not remove %s (%s); it is removed at the next start",
                             partial, e)

    def _after_commit(self, result: SaveResult) -> None:
        self._last = result
        if self.rank != 0:
            faults.hit("after-commit-before-retention", self.rank, result.step)
            return
        s = result.stats
        self.log.info("checkpoint step %d committed: %s, stall %.3f s, persist %.2f GB/s "
                      "(rank 0), commit %.0f ms -> %s", result.step,
                      log.human_bytes(s.get("bytes", 0)), s["stall_s"], s.get("persist_GBps", 0),
                      s.get("commit_s", 0) * 1e3, result.path)
        # the checkpoint is committed on every rank: what follows may fail (a full disk, no
        # write permission) without undoing it or stopping the training
        stats = os.path.join(self.root, "stats.jsonl")
        try:
            _rotate(stats)
            fd = os.open(stats, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         layout.FILE_MODE)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps({"step": result.step, "time": time.time(), **s}) + "\n")
        except OSError as e:
            self.log.warning("could not append step %d's figures to %s: %s", result.step, stats, e)
        faults.hit("after-commit-before-retention", 0, result.step)
        self._retain(result)

    def _retain(self, result: SaveResult) -> None:
        """Rank 0, after a commit: remove the committed checkpoints no rule of the retention
        policy keeps (the one just committed is always kept)."""
        policy = self.retention
        if not policy.deletes:
            return
        committed = dict(layout.committed(self.root))
        self._metadata[result.step] = result.metadata
        doomed, _ = retention.plan(policy, [(step, self._metadata_of(step, path) if policy.best
                                             else {}) for step, path in committed.items()])
        for step in doomed:
            if step == result.step:
                continue
            self.log.info("retention (%s): removing step %d", policy.describe(), step)
            self._metadata.pop(step, None)
            try:
                layout.remove(committed[step], self.run_id)
            except OSError as e:
                self.log.warning("retention could not remove %s: %s; what is left of it is "
                                 "removed at a later start", committed[step], e)

    def _metadata_of(self, step: int, path: str) -> dict[str, Any]:
        """The user metadata of a committed step (read from its manifest once)."""
        if step not in self._metadata:
            try:
                self._metadata[step] = Manifest.from_json(read_bytes(path), path).metadata
            except ManifestError as e:  # unranked, so kept only by the other rules
                self.log.warning("retention cannot rank step %d by %s: %s", step,
                                 self.retention.best, e)
                self._metadata[step] = {}
        return self._metadata[step]

    # ----------------------------------------------------------------------------------- restore

    def restore(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the newest checkpoint that every rank can load (or ``step``) into ``state`` in
        place; return its step, or None when there is none. Collective.

        Details, including skipped checkpoints and the user metadata, are in ``restore_info``.
        """
        self._check_open()
        self.wait()
        t0 = time.perf_counter()
        candidates = self._collective(
            lambda: layout.committed(self.root, require_manifest=False), "list", root_only=True)
        if step is not None:
            candidates = [c for c in candidates if c[0] == step]
            if not candidates:
                raise CheckpointError(f"no checkpoint of step {step} under {self.root}")
        try:
            info = Restorer(self._proto, self._pool, self.io_threads, self.log,
                            self.replicated, self.world_change).run(
                state, candidates, explicit=step is not None)
            info.total_bytes_read = self._proto.sum(info.bytes_read, "restored")
        except CollectiveTimeout as e:
            self._timed_out(e)
            raise
        info.seconds = time.perf_counter() - t0
        self.restore_info = info
        if self.rank == 0:
            if info.step is None:
                self.log.info("no loadable checkpoint under %s: fresh start%s", self.root,
                              f" ({len(info.skipped)} skipped)" if info.skipped else "")
            else:
                self.log.info("restored step %d from %s in %.2f s: %s read by %d rank(s), "
                              "%.2f GB/s", info.step, info.path, info.seconds,
                              log.human_bytes(info.total_bytes_read), self.world_size,
                              info.total_bytes_read / max(info.seconds, 1e-9) / 1e9)
        return info.step

    # ------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Wait for the saves in flight, meet the other ranks and release the private
        communicators. Collective: a rank that never gets here (hung after a commit, say) makes
        the others miss the deadline of the 'close' barrier and abort the job, rather than hang
        in MPI_Finalize."""
        if not self._closed:
            self.wait()
            self._worker.shutdown()
            self._closed = True
            _OPEN.discard(self)
            try:
                self._exit_vote.free()
                self._proto.barrier("close")
            except CollectiveTimeout as e:
                self._timed_out(e)
                raise
            self._proto.free()

    def _finish_in_flight(self, why: str) -> bool:
        """Wait for this Checkpointer's saves in flight; whether they all committed."""
        if self._closed or not self._pending:
            return True
        steps = ", ".join(str(h.step) for h in self._pending)
        if self.rank == 0:
            self.log.warning("%s: waiting for the save of step %s to commit", why, steps)
        results = [h._future.result() for h in self._pending]
        self._pending = []
        failed = [r for r in results if not r.committed]
        for r in failed:
            self.log.error("%s, and the save of step %d could not commit (%s): it is lost; "
                           "exiting with code %d", why, r.step, r.error, EXIT_FAILED)
        return not failed

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _check_shards(partial: str, ranks: list[RankEntry]) -> None:
    """Before the commit, on rank 0: every rank's shard is in the partial directory as rank 0
    sees it, of the size its rank wrote (a ROOT that is not shared leaves them elsewhere)."""
    sizes: dict[str, int] = {}
    with os.scandir(partial) as entries:
        for e in entries:
            if e.is_file(follow_symlinks=False):
                sizes[e.name] = e.stat(follow_symlinks=False).st_size
    missing = [e.rank for e in ranks if e.file not in sizes]
    if missing:
        raise CheckpointError(f"the shards of {ranks_text(missing)} are not in {partial} as "
                              f"rank 0 sees it, although they were written: {NOT_SHARED_ADVICE}")
    wrong = [e.rank for e in ranks if sizes[e.file] != e.bytes]
    if wrong:
        raise CheckpointError(f"the shards of {ranks_text(wrong)} in {partial} are not of the "
                              "size their ranks wrote")


def _fingerprint(root: str) -> tuple[int, list[str]]:
    """What tells two directories apart without writing to them: inode and entries."""
    return os.stat(root).st_ino, sorted(os.listdir(root))


def _rotate(stats: str) -> None:
    """Bound ROOT/stats.jsonl: at STATS_MAX_BYTES it becomes ``stats.jsonl.1``."""
    try:
        size = os.lstat(stats).st_size
    except FileNotFoundError:
        return
    if size >= STATS_MAX_BYTES:
        os.replace(stats, stats + ".1")
