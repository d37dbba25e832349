"""The protocol layer's :class:`~mpickpt.mpi.comm.Comm` for a job of one process that no
launcher started: every collective is this rank's alone and completes at once, a message to
itself is a copy, and MPI is never started.

Starting MPI as a singleton costs a process 0.4-0.8 s (Open MPI on an H200 host), more than
all of a small job's saves; :func:`mpickpt.mpi.backend.backend` takes this only where nothing
says the process has peers (no MPI or torch launcher's variables, no several-task Slurm step,
mpi4py not initialised). Objects go through pickle and messages through JSON as over MPI, so a
rank never shares a mutable object with what it "received".
"""

from __future__ import annotations

import collections
import json
import pickle
import socket
import time
from typing import Any

from .. import knobs

_OPENED: list[bool] = [False]


def opened() -> bool:
    """Whether a job's communicator of one process was opened here."""
    return _OPENED[0]


class _Done:
    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def test(self) -> bool:
        return True

    def result(self) -> Any:
        return self.value


def _bytes(buf: Any) -> memoryview:
    return memoryview(buf).cast("B")


class _Recv:
    """A receive from this rank itself: complete once a send of its tag was made."""

    __slots__ = ("buf", "comm", "done", "tag")

    def __init__(self, comm: SelfComm, buf: Any, tag: int) -> None:
        self.comm, self.buf, self.tag, self.done = comm, buf, tag, False

    def test(self) -> bool:
        if not self.done:
            sent = self.comm._sent.get(self.tag)
            if not sent:
                return False
            data = sent.popleft()
            out = _bytes(self.buf)
            if len(data) > len(out):
                raise ValueError(f"a message of {len(data)} bytes to a receive of {len(out)}")
            out[:len(data)] = data
            self.done = True
        return True


def _copy(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


class SelfComm:
    """One rank, rank 0 of 1 (see the module)."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self._sent: dict[int, collections.deque[bytes]] = {}
        self._posted: dict[int, collections.deque[dict[str, Any]]] = {}

    def dup(self) -> SelfComm:
        return SelfComm()

    def split(self, color: int, key: int) -> SelfComm:
        return SelfComm()

    def node_keys(self) -> list[tuple[int, str]]:
        return [(0, socket.gethostname())]

    def ibarrier(self) -> _Done:
        return _Done()

    def iallreduce(self, send: Any, recv: Any, op: str) -> _Done:
        if op not in ("min", "max", "sum"):
            raise ValueError(f"unknown reduction {op!r}")
        _bytes(recv)[:] = _bytes(send)  # one rank: the reduction is its own values
        return _Done()

    def isend(self, buf: Any, dest: int, tag: int) -> _Done:
        self._check(dest)
        self._sent.setdefault(tag, collections.deque()).append(bytes(_bytes(buf)))
        return _Done()

    def irecv(self, buf: Any, source: int, tag: int) -> _Recv:
        self._check(source)
        return _Recv(self, buf, tag)

    def waitall(self, reqs: list[Any]) -> str | None:
        """Block until every request ends, as MPI's would: a receive waits for its send (from
        another thread of this rank), at most ``$MPICKPT_TIMEOUT`` seconds."""
        give_up = time.monotonic() + knobs.TIMEOUT.get()
        while not all(r.test() for r in reqs):
            if time.monotonic() > give_up:
                return "a receive from this rank that it never sent (a job of one rank)"
            time.sleep(0.001)
        return None

    def allgather(self, obj: Any) -> list[Any]:
        return [_copy(obj)]

    def ibcast(self, obj: Any, root: int, flat: bool = False) -> _Done:
        self._check(root)
        return _Done(obj)  # as MpiComm's root keeps its own object

    def igather(self, obj: Any, root: int, flat: bool = False) -> _Done:
        self._check(root)
        return _Done([obj if flat else _copy(obj)])  # as MpiComm's flat root keeps its own

    def iallgather(self, obj: Any) -> _Done:
        return _Done([_copy(obj)])

    def ialltoall(self, objs: list[Any]) -> _Done:
        if len(objs) != 1:
            raise ValueError(f"{len(objs)} objects for a job of one rank")
        return _Done([_copy(objs[0])])

    def post(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        self._check(dest)
        self._posted.setdefault(tag, collections.deque()).append(json.loads(json.dumps(obj)))

    def take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        posted = self._posted.get(tag)
        return (0, posted.popleft()) if posted else None

    def free(self) -> None:
        self._sent.clear()
        self._posted.clear()

    @staticmethod
    def _check(peer: int) -> None:
        if peer != 0:
            raise ValueError(f"rank {peer} in a job of one rank")


def world() -> SelfComm:
    """The job: this process alone."""
    _OPENED[0] = True
    return SelfComm()
