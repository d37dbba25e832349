"""The protocol layer's :class:`~mpickpt.mpi.comm.Comm` over MPI (mpi4py).

Object collectives are two non-blocking collectives, the sizes and then the pickled bytes, which
the protocol polls with naps like any other: a blocking ``comm.gather`` spins in MPI's progress
loop while it waits for a rank that is not there yet (4.6 ms of rank 0's CPU per save, 4 ranks on
2 cores, in bench/bench_frequent.py), and that CPU is the training's.

A *flat* gather or broadcast (a save's vote and its outcome) is point to point instead
(:mod:`mpickpt.mpi.flat`).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import flat as flat_

_OPS = {"min": MPI.MIN, "max": MPI.MAX, "sum": MPI.SUM}


def world() -> Any:
    return MPI.COMM_WORLD


class _Req:
    __slots__ = ("req",)

    def __init__(self, req: MPI.Request) -> None:
        self.req = req

    def test(self) -> bool:
        try:
            return bool(self.req.Test())
        except MPI.Exception as e:
            raise flat_.comm_error(e) from None


class _Staged:
    """A request in steps: when one completes, ``then`` (if any) starts the next; ``finish``
    gives the result once the last has."""

    __slots__ = ("finish", "req", "then")

    def __init__(self, req: MPI.Request, then: Callable[[], MPI.Request] | None,
                 finish: Callable[[], Any]) -> None:
        self.req, self.then, self.finish = req, then, finish

    def test(self) -> bool:
        try:
            while self.req.Test():
                if self.then is None:
                    return True
                self.req, self.then = self.then(), None
        except MPI.Exception as e:
            raise flat_.comm_error(e) from None
        return False

    def result(self) -> Any:
        return self.finish()


def _split(buf: bytearray, counts: list[int]) -> list[Any]:
    out, at = [], 0
    for n in counts:
        out.append(pickle.loads(memoryview(buf)[at:at + n]))
        at += n
    return out


def _displs(counts: list[int]) -> list[int]:
    return [0, *np.cumsum(counts[:-1]).tolist()] if counts else []


class MpiComm:
    """An mpi4py communicator, as the protocol layer uses it."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.flat = flat_.Flat(comm)  # the flat collectives' count and early messages

    def dup(self) -> MpiComm:
        return MpiComm(self.comm.Dup())

    def split(self, color: int, key: int) -> MpiComm:
        return MpiComm(self.comm.Split(color, key))

    def node_keys(self) -> list[tuple[int, str]]:
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            leader = local.allreduce(self.rank, op=MPI.MIN)
        finally:
            local.Free()
        # the host name as the other backends give it (MPI's processor name may differ: Open
        # MPI drops the domain), so that a node's directory is the same under any launcher
        return [tuple(k) for k in self.comm.allgather((leader, socket.gethostname()))]

    def ibarrier(self) -> _Req:
        return _Req(self.comm.Ibarrier())

    def iallreduce(self, send: Any, recv: Any, op: str) -> _Req:
        return _Req(self.comm.Iallreduce(send, recv, op=_OPS[op]))

    def isend(self, buf: Any, dest: int, tag: int) -> _Req:
        return _Req(self.comm.Isend(buf, dest, tag))

    def irecv(self, buf: Any, source: int, tag: int) -> _Req:
        return _Req(self.comm.Irecv(buf, source, tag))

    def waitall(self, reqs: list[_Req]) -> str | None:
        try:
            MPI.Request.Waitall([r.req for r in reqs])
        except MPI.Exception as e:
            return str(e.Get_error_string().strip())
        return None

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def ibcast(self, obj: Any, root: int, flat: bool = False) -> _Staged | flat_.FlatBcast:
        if flat and self.size <= flat_.BCAST_RANKS:
            return self.flat.bcast(obj, root)
        mine = self.rank == root
        data = pickle.dumps(obj) if mine else b""
        n = np.array([len(data)], dtype=np.int64)
        buf: list[Any] = [data]

        def then() -> MPI.Request:
            if not mine:
                buf[0] = bytearray(int(n[0]))
            return self.comm.Ibcast([buf[0], MPI.BYTE], root=root)

        return _Staged(self.comm.Ibcast([n, MPI.INT64_T], root=root), then,
                       lambda: obj if mine else pickle.loads(buf[0]))

    def igather(self, obj: Any, root: int, flat: bool = False) -> _Staged | flat_.FlatGather:
        if flat:
            return self.flat.gather(obj, root)
        mine = self.rank == root
        data = pickle.dumps(obj)
        n = np.array([len(data)], dtype=np.int64)
        sizes = np.zeros(self.size, dtype=np.int64)
        got = bytearray()

        def then() -> MPI.Request:
            if not mine:
                return self.comm.Igatherv([data, MPI.BYTE], None, root=root)
            counts = sizes.tolist()
            got.extend(bytes(sum(counts)))
            return self.comm.Igatherv([data, MPI.BYTE],
                                      [got, (counts, _displs(counts)), MPI.BYTE], root=root)

        return _Staged(self.comm.Igather([n, MPI.INT64_T], [sizes, MPI.INT64_T], root=root),
                       then, lambda: _split(got, sizes.tolist()) if mine else None)

    def iallgather(self, obj: Any) -> _Staged:
        data = pickle.dumps(obj)
        n = np.array([len(data)], dtype=np.int64)
        sizes = np.zeros(self.size, dtype=np.int64)
        got = bytearray()

        def then() -> MPI.Request:
            counts = sizes.tolist()
            got.extend(bytes(sum(counts)))
            return self.comm.Iallgatherv([data, MPI.BYTE],
                                         [got, (counts, _displs(counts)), MPI.BYTE])

        return _Staged(self.comm.Iallgather([n, MPI.INT64_T], [sizes, MPI.INT64_T]), then,
                       lambda: _split(got, sizes.tolist()))

    def ialltoall(self, objs: list[Any]) -> _Staged:
        datas = [pickle.dumps(o) for o in objs]
        send_n = np.array([len(d) for d in datas], dtype=np.int64)
        recv_n = np.zeros(self.size, dtype=np.int64)
        out = bytearray(b"".join(datas))
        got = bytearray()

        def then() -> MPI.Request:
            sc, rc = send_n.tolist(), recv_n.tolist()
            got.extend(bytes(sum(rc)))
            return self.comm.Ialltoallv([out, (sc, _displs(sc)), MPI.BYTE],
                                        [got, (rc, _displs(rc)), MPI.BYTE])

        return _Staged(self.comm.Ialltoall([send_n, MPI.INT64_T], [recv_n, MPI.INT64_T]), then,
                       lambda: _split(got, recv_n.tolist()))

    def post(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        buf = bytearray(json.dumps(obj).encode())
        with contextlib.suppress(MPI.Exception):  # a dead peer: it is reported missing anyway
            self.flat.sent(self.comm.Isend([buf, MPI.BYTE], dest, tag))  # never waited on:
            # a dead rank never receives it

    def take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        status = MPI.Status()
        try:
            msg = flat_.probe(self.comm, MPI.ANY_SOURCE, tag, status)
            if msg is None:
                return None
            buf = bytearray(status.Get_count(MPI.BYTE))
            msg.Recv([buf, MPI.BYTE])
            obj = json.loads(buf.decode())
        except (MPI.Exception, ValueError):
            return None
        return status.Get_source(), obj if isinstance(obj, dict) else {}

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL and self.comm != MPI.COMM_WORLD:
            self.comm.Free()
