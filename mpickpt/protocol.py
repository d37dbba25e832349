"""The collectives of the checkpoint protocol, each with a deadline, on a private communicator.

This module and :mod:`mpickpt.run` are the only ones that talk MPI. Every collective is started
non-blocking and polled until it completes or its deadline passes; object collectives are preceded
by such a barrier, so a blocking transfer only starts once every rank has arrived. A missed
deadline raises :class:`~mpickpt.errors.CollectiveTimeout`; the communicator is unusable after it.
Payloads are our own small str/int/dict values, never user data from a checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import CollectiveTimeout

DEFAULT_TIMEOUT = 900.0


class Protocol:
    """Collectives with deadlines on ``comm.Dup()`` (``MPI.COMM_WORLD`` when ``comm`` is None)."""

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.timeout = timeout

    def local_size(self) -> int:
        """How many ranks of this communicator share this rank's node."""
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size()
        finally:
            local.Free()

    def _wait(self, req: MPI.Request, phase: str) -> None:
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not req.Test():
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"rank {self.rank}: the other ranks did not all reach phase {phase!r} "
                    f"within {self.timeout:g} s; a rank has died or hangs"
                )
            spins += 1
            if spins > 200:
                time.sleep(0.0005)

    def barrier(self, phase: str) -> None:
        self._wait(self.comm.Ibarrier(), phase)

    def _allreduce(self, value: int, op: MPI.Op, phase: str) -> int:
        send = np.array([value], dtype=np.int64)
        recv = np.empty(1, dtype=np.int64)
        self._wait(self.comm.Iallreduce(send, recv, op=op), phase)
        return int(recv[0])

    def all_ok(self, ok: bool, phase: str) -> bool:
        """The vote: True only if every rank says ok."""
        return bool(self._allreduce(int(ok), MPI.MIN, phase))

    def max(self, value: int, phase: str) -> int:
        return self._allreduce(value, MPI.MAX, phase)

    def bcast(self, obj: Any, phase: str, root: int = 0) -> Any:
        self.barrier(phase)
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any, phase: str, root: int = 0) -> list[Any] | None:
        self.barrier(phase)
        return self.comm.gather(obj, root=root)

    def allgather(self, obj: Any, phase: str) -> list[Any]:
        self.barrier(phase)
        return self.comm.allgather(obj)

    def exit_vote(self) -> ExitVote:
        """A non-blocking agreement on a flag, on its own duplicate of the communicator."""
        return ExitVote(self.comm)

    def abort(self, code: int) -> None:
        """End the whole job (after a missed deadline the communicator cannot be trusted)."""
        self.comm.Abort(code)

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


class ExitVote:
    """Agree across ranks whether any rank wants to stop, without a blocking collective per step.

    Every rank calls :meth:`poll` once per training step. A call completes the allreduce (MAX)
    started by the previous call, which every rank posted a step ago, so in a job whose ranks
    move in step the wait is nil, and starts the next one with this rank's flag. All ranks learn
    a raised flag at the same call, hence at the same step. Its own communicator keeps it apart
    from the saves running on the background thread.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self._send = np.zeros(2, dtype=np.int64)
        self._recv = np.zeros(2, dtype=np.int64)
        self._req: MPI.Request | None = None

    def poll(self, flag: int, rank: int) -> tuple[int, int] | None:
        """None while every rank's flag is 0; else (the highest flag, the highest rank that
        raised a flag)."""
        agreed = None
        if self._req is not None:
            self._req.Wait()
            self._req = None
            if self._recv[0]:
                agreed = int(self._recv[0]), int(self._recv[1]) - 1
        if agreed is None:
            self._send[:] = (flag, rank + 1 if flag else 0)
            self._req = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)
        return agreed

    def free(self) -> None:
        """Collective: complete the allreduce in flight (every rank has the same one), release."""
        if self._req is not None:
            self._req.Wait()
            self._req = None
        self.comm.Free()
