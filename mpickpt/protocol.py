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

    def abort(self, code: int) -> None:
        """End the whole job (after a missed deadline the communicator cannot be trusted)."""
        self.comm.Abort(code)

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
