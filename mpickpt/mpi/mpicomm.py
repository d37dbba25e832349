"""The protocol layer's :class:`~mpickpt.mpi.comm.Comm` over MPI (mpi4py)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from mpi4py import MPI

from .comm import CommError

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
            raise CommError(f"MPI reported: {e.Get_error_string().strip()}") from None


class MpiComm:
    """An mpi4py communicator, as the protocol layer uses it."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self._sends: list[tuple[Any, bytearray]] = []  # never waited on: a dead rank never acks

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
        return [tuple(k) for k in self.comm.allgather((leader, MPI.Get_processor_name()))]

    def ibarrier(self) -> _Req:
        return _Req(self.comm.Ibarrier())

    def iallreduce(self, send: Any, recv: Any, op: str) -> _Req:
        return _Req(self.comm.Iallreduce(send, recv, op=_OPS[op]))

    def ireduce_scatter_xor(self, send: Any, recv: Any) -> _Req:
        return _Req(self.comm.Ireduce_scatter_block(send, recv, op=MPI.BXOR))

    def ireduce_xor(self, send: Any, recv: Any, root: int) -> _Req:
        return _Req(self.comm.Ireduce(send, recv, op=MPI.BXOR, root=root))

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

    def bcast(self, obj: Any, root: int) -> Any:
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        return self.comm.gather(obj, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def alltoall(self, objs: list[Any]) -> list[Any]:
        return self.comm.alltoall(objs)

    def post(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        buf = bytearray(json.dumps(obj).encode())
        with contextlib.suppress(MPI.Exception):  # a dead peer: it is reported missing anyway
            self._sends.append((self.comm.Isend([buf, MPI.BYTE], dest, tag), buf))

    def take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        status = MPI.Status()
        try:
            msg = self.comm.Improbe(MPI.ANY_SOURCE, tag, status)
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
