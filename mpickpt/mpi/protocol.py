"""The collectives of the checkpoint protocol, each with a deadline, on a private communicator.

This module and :mod:`mpickpt.run` are the only ones that talk MPI (or, without MPI, gloo:
:mod:`mpickpt.mpi.backend` says which). Every collective is started
non-blocking and polled until it completes or its deadline passes, object collectives too (over
MPI the sizes and then the bytes, each non-blocking; over gloo a barrier, then the transfer, which
only starts once every rank has arrived). A missed
deadline raises :class:`~mpickpt.errors.CollectiveTimeout`; the communicator is unusable after it.
Payloads are our own small str/int/dict values, never user data from a checkpoint.
Who did not arrive, when a deadline passes: :mod:`mpickpt.mpi.rollcall`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np

from .. import knobs
from ..errors import CheckpointError, CollectiveTimeout, RankFailure
from ..exitcodes import EXIT_COLLECTIVE_TIMEOUT
from ..ranks import by_reason, ranks_text
from .backend import abort_world, open_comm
from .backend import world_rank as world_rank  # re-exported
from .comm import ObjectRequest, Request
from .polling import BRISK_NAP_S, POLL_NAP_MAX_S, Patience, Waker
from .rollcall import RollCall

T = TypeVar("T")
DEFAULT_TIMEOUT = knobs.TIMEOUT.default
TAG_DATA = 0x6D80  # the node-local level's shard copies (mpickpt.local.exchange), point to point


def resolve_timeout(timeout: float | None) -> float:
    """``timeout``, else ``$MPICKPT_TIMEOUT`` (seconds), else 900 s."""
    return float(timeout) if timeout is not None else knobs.TIMEOUT.get()


def resolve_grace(grace: float | None) -> float:
    """``grace``, else ``$MPICKPT_TIMEOUT_GRACE`` (seconds), else 5 s."""
    return float(grace) if grace is not None else knobs.TIMEOUT_GRACE.get()


class Protocol:
    """Collectives with deadlines on a duplicate of ``comm`` (an mpi4py communicator or a
    :class:`~mpickpt.mpi.comm.Comm`; the whole job when None, over MPI or gloo).

    ``timeout`` (default ``$MPICKPT_TIMEOUT``, else 900 s) is each collective's deadline;
    ``grace`` (default ``$MPICKPT_TIMEOUT_GRACE``, else 5 s) bounds the roll call after a missed
    one (see the module docstring).
    """

    def __init__(self, comm: Any = None, timeout: float | None = None,
                 grace: float | None = None) -> None:
        self.comm = open_comm(comm).dup()
        self.rank: int = self.comm.rank
        self.size: int = self.comm.size
        self.timeout = resolve_timeout(timeout)
        self.grace = resolve_grace(grace)
        self._roll = RollCall(self.comm, self.grace)
        self._abort_delay = 0.0
        self.collectives = 0  # collective operations this rank has completed (a statistic)
        self.nap_max = POLL_NAP_MAX_S  # the longest nap between two tests of a collective
        self._patience = Patience()  # how long a save's last waits lasted, phase by phase
        self.waker = Waker()  # who waits for the save thread (its idle waits doze meanwhile)
        self._on_free: list[Callable[[], None]] = []

    def local_size(self) -> int:
        """How many ranks of this communicator share this rank's node (collective)."""
        keys = self.comm.node_keys()
        return sum(1 for k in keys if k[0] == keys[self.rank][0])

    def nodes(self, override: str | None) -> list[str]:
        """The node name of every rank: ranks that share memory (MPI's shared-memory split) are
        one node, named after the host name of its lowest rank (``socket.gethostname()``, under
        every backend); ``override`` (``$MPICKPT_NODE``), when every rank sets it, names the
        nodes instead (several simulated nodes on one host)."""
        leader, host = self.comm.node_keys()[self.rank]
        keys = self.allgather((override or None, leader, host), "nodes")
        set_on = [r for r, k in enumerate(keys) if k[0]]
        if set_on and len(set_on) != self.size:
            raise ValueError(
                f"MPICKPT_NODE is set on {ranks_text(set_on)} but not on the others: set it on "
                "every rank (it names each rank's node) or on none")
        if set_on:
            return [str(k[0]) for k in keys]
        hosts = {k[1]: keys[k[1]][2] for k in keys}
        same = {h for h in hosts.values() if list(hosts.values()).count(h) > 1}
        return [hosts[k[1]] if hosts[k[1]] not in same else f"{hosts[k[1]]}-{k[1]}"
                for k in keys]

    def sub(self, color: int, key: int) -> Protocol:
        """The ranks of the same ``color``, ordered by ``key``, as a Protocol of their own
        (collective)."""
        split = self.comm.split(color, key)
        try:
            sub = Protocol(split, self.timeout, self.grace)
            sub.nap_max = self.nap_max  # (an XOR team formed in a restore waits as briskly)
            return sub
        finally:
            split.free()

    def start(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]],
              phase: str) -> Pending:
        """Start sending each buffer to its rank and receiving each from its rank, point to
        point; :meth:`Pending.wait` ends them within the deadline."""
        reqs = [self.comm.irecv(buf, src, TAG_DATA) for buf, src in recvs]
        reqs += [self.comm.isend(buf, dest, TAG_DATA) for buf, dest in sends]
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        return Pending(self, reqs, f"{phase} with {ranks_text(peers)}")

    def start_gated(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]],
                    ready: Callable[[int], bool], phase: str) -> Pending:
        """:meth:`start`, with each send posted once ``ready(k)`` (which may block a moment)
        says that its buffer is filled, in order. The receives are posted first, and the
        transfer thread waits for them meanwhile: its ``Waitall`` drives MPI's progress, so the
        windows posted move while the next ones fill. (Testing from this thread between waits
        instead left the windows to crawl through Open MPI's 32 KiB shared-memory fragments, or,
        testing without pause, starved the shard's writers of the GIL: 1.5-3.5 s against
        1.2-1.3 s for 2.8 GB per rank on an H100.) Within the deadline."""
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        what = f"{phase} with {ranks_text(peers)}"
        received = Pending(self, [self.comm.irecv(buf, src, TAG_DATA) for buf, src in recvs],
                           what)
        deadline, sent = time.monotonic() + self.timeout, []
        for k, (buf, dest) in enumerate(sends):
            while not ready(k):
                if time.monotonic() > deadline:
                    self._abort_delay = self.grace
                    raise CollectiveTimeout(f"rank {self.rank}: {what}: its data was not ready "
                                            f"within {self.timeout:g} s")
            sent.append(self.comm.isend(buf, dest, TAG_DATA))
        # on the one transfer thread, after the receives' wait: its result first
        return Pending(self, sent, what, job=lambda: received.result() or self.comm.waitall(sent))

    def start_grouped(self, sends: list[tuple[Any, int]],
                      groups: Sequence[list[tuple[Any, int]]], phase: str, ahead: int = 4,
                      before_post: Callable[[int], None] | None = None,
                      peers: list[int] | None = None) -> list[Pending]:
        """:meth:`start` with the receives in groups: a :class:`Pending` per group, in order,
        then one for the sends. Only ``ahead`` groups are posted at a time, the next as each
        one is in, so that they arrive in order (posted all at once, MPI moves them side by
        side and the first is complete only near the end of all): a group can be used as soon
        as its own wait returns while the next ones move. ``before_post(k)`` returns once
        group ``k``'s buffers may be written (a ring of buffers: once an earlier group's are
        used); it runs on the transfer thread, and an error it raises fails the transfer.
        ``peers``: the ranks the groups receive from, where ``groups`` makes each group only
        when it is posted (they name the transfer in errors); the first groups are then posted
        on the transfer thread too, after the sends have started, so that a group whose
        buffers are not there yet does not hold the sends up."""
        return _grouped(self, sends, groups, phase, ahead, before_post, peers)

    def transfer(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]],
                 phase: str) -> None:
        """:meth:`start`, and wait for it."""
        self.start(sends, recvs, phase).wait()

    def complete(self, req: Request, roll: RollCall, phase: str, idle: bool = False) -> None:
        """:func:`poll` ``req`` (``idle``: it may doze); past the deadline (or on rank 0's roll
        call, or an MPI error) account for the missing ranks and raise CollectiveTimeout."""
        error = self._patience.poll(req, roll, phase, self.timeout, self.nap_max,
                                    doze=self.waker.doze if idle else None)
        if error is None:
            return
        details = roll.account()
        # rank 0 reported: everyone heard at once; else the others' deadlines may come later
        self._abort_delay = min(1.0, self.grace) if roll.coordinated else self.grace
        raise CollectiveTimeout(
            f"rank {self.rank}: the other ranks did not all reach phase {phase!r} within "
            f"{self.timeout:g} s{error}; {details}"
        )

    @contextlib.contextmanager
    def brisk(self) -> Iterator[None]:
        """Naps of at most :data:`~mpickpt.mpi.polling.BRISK_NAP_S` between tests within
        (:func:`~mpickpt.mpi.polling.poll`): for a restore, which the job waits for, not a
        save, whose every test is CPU taken from the training loop."""
        before, self.nap_max = self.nap_max, BRISK_NAP_S
        try:
            yield
        finally:
            self.nap_max = before

    def _wait(self, req: Request, phase: str, joint: bool = True, idle: bool = False) -> None:
        """``joint``: the collective completes here only once every rank joined it (not so a
        gather's on a rank that only sends: the roll call's "last seen" stays before it)."""
        self._roll.enter(f"phase {phase!r} (collective #{self._roll.seq + 1})")
        self.complete(req, self._roll, phase, idle)
        if joint:
            self._roll.complete()
        self.collectives += 1

    def barrier(self, phase: str) -> None:
        self._wait(self.comm.ibarrier(), phase)

    def _allreduce(self, value: int, op: str, phase: str) -> int:
        return self._allreduce_all([value], op, phase)[0]

    def _allreduce_all(self, values: list[int], op: str, phase: str) -> list[int]:
        send = np.array(values, dtype=np.int64)
        recv = np.empty(len(values), dtype=np.int64)
        self._wait(self.comm.iallreduce(send, recv, op), phase)
        return [int(v) for v in recv]

    def all_ok(self, ok: bool, phase: str) -> bool:
        """The vote: True only if every rank says ok."""
        return bool(self._allreduce(int(ok), "min", phase))

    def agree(self, error: str | None, phase: str, report: str | None = None
              ) -> Failures | None:
        """Every rank votes on whether it did its part of ``phase`` (``error`` None if it did);
        if one did not, every rank learns each failed rank's reason (collective ``report``,
        ``PHASE-report`` by default). None when every rank succeeded."""
        if self.all_ok(error is None, phase):
            return None
        reasons = self.allgather(error, report or f"{phase}-report")
        return Failures(tuple(RankFailure(r, phase, m) for r, m in enumerate(reasons) if m))

    def max(self, value: int, phase: str) -> int:
        return self._allreduce(value, "max", phase)

    def maxes(self, values: list[int], phase: str) -> list[int]:
        """Each value's maximum over every rank, in one collective."""
        return self._allreduce_all(values, "max", phase)

    def sum(self, value: int, phase: str) -> int:
        return self._allreduce(value, "sum", phase)

    def sums(self, values: list[int], phase: str) -> list[int]:
        """Each value summed over every rank, in one collective."""
        return self._allreduce_all(values, "sum", phase)

    def _objects(self, req: ObjectRequest, phase: str, joint: bool = True) -> Any:
        self._wait(req, phase, joint)
        return req.result()

    def bcast(self, obj: Any, phase: str, root: int = 0, flat: bool = False,
              idle: bool = False) -> Any:
        """``flat`` (also a gather's): point to point, see :mod:`mpickpt.mpi.flat`. ``idle``: an
        outcome the others may doze for, where none forwards it (:class:`~.polling.Waker`)."""
        req = self.comm.ibcast(obj, root, flat)
        self._wait(req, phase, idle=idle and self.rank != root and getattr(req, "direct", False))
        return req.result()

    def gather(self, obj: Any, phase: str, root: int = 0, flat: bool = False) -> list[Any] | None:
        return self._objects(self.comm.igather(obj, root, flat), phase, joint=self.rank == root)

    def allgather(self, obj: Any, phase: str) -> list[Any]:
        return self._objects(self.comm.iallgather(obj), phase)

    def alltoall(self, objs: list[Any], phase: str) -> list[Any]:
        """Send ``objs[r]`` to rank r; what every rank sent this one, by rank."""
        return self._objects(self.comm.ialltoall(objs), phase)

    def abort(self, code: int) -> NoReturn:
        """End the whole job (after a missed deadline the communicator cannot be trusted).

        After a missed deadline, first wait a moment so that the other ranks, which learn of it
        at about the same time (or, when rank 0 was silent, within ``grace``), log it too.
        ``MPI_COMM_WORLD`` is aborted, not the private communicator: MPICH ends only the calling
        process for another communicator, the launcher then SIGKILLs the rest, and the job's exit
        code came out as 9 instead of ``code`` about one time in three. Without MPI the process
        ends with ``code``, and torchrun's agent ends the others.
        """
        if self._abort_delay:
            time.sleep(self._abort_delay)
        abort_world(code)

    @contextlib.contextmanager
    def fatal_timeouts(self, log: logging.Logger) -> Iterator[None]:
        """Around collectives whose missed deadline ends the job: the communicator cannot be
        trusted any more, so say so and abort (exit code 75) rather than hang or go on."""
        try:
            yield
        except CollectiveTimeout as e:
            log.error("%s; aborting the job (exit code %d), the last committed checkpoint stays "
                      "loadable", e, EXIT_COLLECTIVE_TIMEOUT)
            self.abort(EXIT_COLLECTIVE_TIMEOUT)

    def everywhere(self, fn: Callable[[], T], phase: str, log: logging.Logger,
                   root_only: bool = False) -> T:
        """Run ``fn`` (on rank 0 only, or on every rank) and raise :class:`CheckpointError` on
        every rank if it failed anywhere; with ``root_only`` every rank gets rank 0's result."""
        value, err = None, None
        if self.rank == 0 or not root_only:
            try:
                value = fn()
            except Exception as e:
                err = f"rank {self.rank}: {type(e).__name__}: {e}"
        with self.fatal_timeouts(log):
            if root_only:
                value, err = self.bcast((value, err), phase)
            elif failed := self.agree(err, phase, report=phase):
                raise CheckpointError(str(failed))
        if err is not None:
            raise CheckpointError(f"{phase} failed: {err}")
        return value  # type: ignore[return-value]

    def on_free(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` at :meth:`free` (what the job holds while its communicator lives)."""
        self._on_free.append(fn)

    def free(self) -> None:
        try:
            self.comm.free()
        finally:
            while self._on_free:
                self._on_free.pop()()


class Pending:
    """Data transfers in flight (the local level's shard copies and parity). One helper thread
    blocks in ``Waitall``, where MPI moves data at full speed (polling with sleeps, as the
    protocol's small collectives do, starves its progress); :meth:`wait` waits for it within the
    deadline, else raises :class:`CollectiveTimeout` (the communicator, and the helper thread,
    are then given up: the job aborts)."""

    def __init__(self, proto: Protocol, reqs: list[Request], what: str,
                 job: Callable[[], str | None] | None = None) -> None:
        """Wait for ``reqs`` on the transfer thread (or run ``job`` there, which waits for
        requests of its own and returns an error text or None)."""
        self._proto, self._what = proto, what
        self._future = _waiter().submit(job or (lambda: proto.comm.waitall(reqs)))

    def done(self) -> bool:
        """Whether its wait would return at once (no blocking)."""
        return self._future.done()

    def result(self) -> str | None:
        """On the transfer thread, after this one's wait: its error text, or None."""
        return self._future.result()

    def wait(self) -> None:
        p = self._proto
        try:
            error = self._future.result(p.timeout)
        except concurrent.futures.TimeoutError:
            p._abort_delay = p.grace
            raise CollectiveTimeout(f"rank {p.rank}: {self._what} did not complete within "
                                    f"{p.timeout:g} s: a peer died or hangs") from None
        if error is not None:
            raise CollectiveTimeout(f"rank {p.rank}: {self._what} failed ({error})")


_WAITER: list[concurrent.futures.ThreadPoolExecutor] = []


@dataclass(frozen=True)
class Failures:
    """What :meth:`Protocol.agree` returns when a rank failed: a record per failed rank."""

    records: tuple[RankFailure, ...]

    @property
    def reasons(self) -> dict[int, str]:
        return {f.rank: f.reason for f in self.records}

    def __str__(self) -> str:
        """The reasons as they were given (each usually names its rank), ``; ``-separated; the
        same reason from more than two ranks once, after their ranks (``ranks 0-31: ...``,
        not 32 times over)."""
        return "; ".join(by_reason([(f.rank, f.reason) for f in self.records]))

    def named(self) -> str:
        """Each reason after its rank: ``rank 1: ...; rank 3: ...``."""
        return "; ".join(str(f) for f in self.records)


def prestart() -> None:
    """The thread that waits on data transfers made now, before it is needed (making a
    thread waits behind the process's page faults: :func:`mpickpt.format.iothreads.prestart`)."""
    _waiter().submit(lambda: None).result()


def _waiter() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that waits on data transfers, started once (MPICH keeps a little memory
    for every thread started after MPI_Init); at the training thread's priority
    (:mod:`mpickpt.background` says why)."""
    if not _WAITER:
        _WAITER.append(concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mpickpt-transfer"))
    return _WAITER[0]


def _grouped(proto: Protocol, sends: list[tuple[Any, int]], groups: Sequence[list[tuple[Any, int]]],
             phase: str, ahead: int, before_post: Callable[[int], None] | None,
             peers: list[int] | None) -> list[Pending]:
    """:meth:`Protocol.start_grouped`'s work."""
    if ahead < 1:
        raise ValueError(f"ahead must be 1 or more, not {ahead}")
    lazy = peers is not None
    peers = sorted({p for _, p in sends} | set(
        peers if peers is not None else (p for g in groups for _, p in g)))
    what = f"{phase} with {ranks_text(peers)}"
    recvs: list[list[Request]] = [[] for _ in range(len(groups))]
    broken: list[str] = []

    def post(k: int) -> None:
        if k < len(groups):
            if before_post is not None:
                before_post(k)
            recvs[k] = [proto.comm.irecv(buf, src, TAG_DATA) for buf, src in groups[k]]

    def arrival(k: int) -> Callable[[], str | None]:
        def job() -> str | None:  # on the transfer thread, after the group before it
            if not k and lazy:  # the first groups (the docstring says why)
                try:
                    for j in range(min(ahead, len(groups))):
                        post(j)
                except Exception as e:
                    broken.append(f"posting receives: {type(e).__name__}: {e}")
            if broken:  # an earlier group, or posting one, failed: the transfer is off
                return broken[0]
            error = proto.comm.waitall(recvs[k])
            if error is not None:
                broken.append(error)
                return error
            try:
                post(k + ahead)
            except Exception as e:  # reported by the wait of the group it was for
                broken.append(f"posting receives: {type(e).__name__}: {e}")
            return None
        return job

    if not lazy:
        for k in range(min(ahead, len(groups))):
            post(k)
    reqs = [proto.comm.isend(buf, dest, TAG_DATA) for buf, dest in sends]
    return ([Pending(proto, [], what, arrival(k)) for k in range(len(groups))]
            + [Pending(proto, reqs, what)])
