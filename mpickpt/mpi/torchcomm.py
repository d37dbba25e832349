"""The protocol layer's :class:`~mpickpt.mpi.comm.Comm` without MPI: process groups of gloo
(CPU, TCP) of mpickpt's own, over the launcher's rendezvous store.

Under torchrun the store is the elastic agent's (``TORCHELASTIC_USE_AGENT_STORE``); under a
launcher that only sets ``MASTER_ADDR``/``MASTER_PORT`` it is ``torch.distributed``'s default
store when the training initialised one, else a TCP store that rank 0 hosts on ``MASTER_PORT``
beside it (multi-tenant, as ``init_process_group`` makes its own). Every group lives under a
prefix of its own (the run, the restart, the group's place in the order every rank makes them),
so the training's process groups, NCCL or gloo, never carry a byte of mpickpt's and never wait
for it. The roll call's messages go through the store (gloo cannot probe for a message of any
source). Object collectives send ``pickle`` bytes between the ranks of one job, as mpi4py's do;
never data read from a checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import socket
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import knobs
from .comm import CommError

_WORLD: list[TorchComm] = []
_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
STORE_TIMEOUT_S = 300.0  # a group's rendezvous; the protocol's own deadlines are on top


def opened_rank() -> int | None:
    """This process's rank, once the job's group was opened here."""
    return _WORLD[0].rank if _WORLD else None


def _store(rank: int, size: int) -> Any:
    env = os.environ
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if size == 1 and "MASTER_ADDR" not in env:
        return dist.HashStore()
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), size,
                             is_master=False, timeout=timeout)
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), size,
                         is_master=rank == 0, timeout=timeout, multi_tenant=True,
                         wait_for_workers=False)


def world() -> TorchComm:
    """The whole job (``RANK`` of ``WORLD_SIZE``; one process when they are unset)."""
    if not _WORLD:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _WORLD.append(TorchComm(_store(rank, size), f"mpickpt/{run}/{restart}/w", rank, size,
                                make=False))
    return _WORLD[0]


def _tensor(buf: Any) -> torch.Tensor:
    """The bytes of ``buf`` (an array, memoryview or bytes-like) as a uint8 tensor, no copy."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    arr = arr.reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only buffer, to send: torch only warns
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class _Req:
    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def test(self) -> bool:
        if not self.work.is_completed():
            return False
        try:
            self.work.wait()
        except RuntimeError as e:
            raise CommError(f"gloo reported: {e}") from None
        return True


class _AfterBarrier(_Req):
    """An object collective: a barrier, polled; then the blocking transfer, which starts once
    every rank has arrived (gloo's transfers wait on sockets and burn no CPU)."""

    __slots__ = ("run",)

    def __init__(self, work: Any, run: Any) -> None:
        super().__init__(work)
        self.run = run

    def result(self) -> Any:
        return self.run()


class TorchComm:
    """A gloo process group of mpickpt's own, as the protocol layer uses it."""

    def __init__(self, store: Any, name: str, rank: int, size: int, make: bool = True) -> None:
        self.store, self.name, self.rank, self.size = store, name, rank, size
        self._children = 0  # the groups made from this one, in the order every rank makes them
        self._seen: dict[int, int] = {}  # messages taken, by tag
        self._pg: Any = self._make() if make else None

    def _make(self) -> Any:
        timeout = datetime.timedelta(seconds=knobs.TIMEOUT.get() + 60)
        return dist.ProcessGroupGloo(dist.PrefixStore(self.name, self.store), self.rank,
                                     self.size, timeout)

    @property
    def pg(self) -> Any:
        if self._pg is None:
            self._pg = self._make()
        return self._pg

    def _child(self, what: str) -> str:
        self._children += 1
        return f"{self.name}.{self._children}{what}"

    def dup(self) -> TorchComm:
        return TorchComm(self.store, self._child(""), self.rank, self.size)

    def split(self, color: int, key: int) -> TorchComm:
        name = self._child("s")
        keys = self.allgather((color, key, self.rank))
        team = sorted((k, r) for c, k, r in keys if c == color)
        return TorchComm(self.store, f"{name}/{color}", team.index((key, self.rank)), len(team))

    def node_keys(self) -> list[tuple[int, str]]:
        hosts = self.allgather(socket.gethostname())
        return [(hosts.index(h), h) for h in hosts]

    # ------------------------------------------------------------------------- non-blocking

    def ibarrier(self) -> _Req:
        return _Req(self.pg.barrier())

    def iallreduce(self, send: Any, recv: Any, op: str) -> _Req:
        recv[...] = send
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        return _Req(self.pg.allreduce([torch.from_numpy(recv)], opts))

    def isend(self, buf: Any, dest: int, tag: int) -> _Req:
        return _Req(self.pg.send([_tensor(buf)], dest, tag))

    def irecv(self, buf: Any, source: int, tag: int) -> _Req:
        return _Req(self.pg.recv([_tensor(buf)], source, tag))

    def waitall(self, reqs: list[_Req]) -> str | None:
        error = None
        for r in reqs:
            try:
                r.work.wait()
            except RuntimeError as e:
                error = error or str(e)
        return error

    # ------------------------------------------- object collectives: a barrier, then blocking

    def ibcast(self, obj: Any, root: int, flat: bool = False) -> _AfterBarrier:
        return _AfterBarrier(self.pg.barrier(), lambda: self.bcast(obj, root))

    def igather(self, obj: Any, root: int, flat: bool = False) -> _AfterBarrier:
        return _AfterBarrier(self.pg.barrier(), lambda: self.gather(obj, root))

    def iallgather(self, obj: Any) -> _AfterBarrier:
        return _AfterBarrier(self.pg.barrier(), lambda: self.allgather(obj))

    def ialltoall(self, objs: list[Any]) -> _AfterBarrier:
        return _AfterBarrier(self.pg.barrier(), lambda: self.alltoall(objs))

    def _sizes(self, n: int) -> list[int]:
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([out], [torch.tensor([n], dtype=torch.int64)]).wait()
        return [int(t) for t in out]

    def allgather(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        sizes = self._sizes(len(data))
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([out], [buf]).wait()
        return [pickle.loads(o[:n].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        data = pickle.dumps(obj)
        sizes = self._sizes(len(data))
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = self.rank == root
        out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.size)] if mine \
            else []
        opts = dist.GatherOptions()
        opts.rootRank = root
        self.pg.gather([out] if mine else [], [buf], opts).wait()
        if not mine:
            return None
        return [pickle.loads(o[:n].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]

    def bcast(self, obj: Any, root: int) -> Any:
        data = pickle.dumps(obj) if self.rank == root else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([n], opts).wait()
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root
               else torch.empty(int(n), dtype=torch.uint8))
        if int(n):
            self.pg.broadcast([buf], opts).wait()
        return obj if self.rank == root else pickle.loads(buf.numpy().tobytes())

    def alltoall(self, objs: list[Any]) -> list[Any]:
        datas = [pickle.dumps(o) for o in objs]
        send_n = torch.tensor([len(d) for d in datas], dtype=torch.int64)
        recv_n = torch.empty(self.size, dtype=torch.int64)
        self.pg.alltoall_base(recv_n, send_n, [], [], dist.AllToAllOptions()).wait()
        inp = torch.frombuffer(bytearray(b"".join(datas)) or bytearray(1), dtype=torch.uint8)
        out = torch.empty(max(int(recv_n.sum()), 1), dtype=torch.uint8)
        self.pg.alltoall_base(out[: int(recv_n.sum())], inp[: int(send_n.sum())],
                              recv_n.tolist(), send_n.tolist(), dist.AllToAllOptions()).wait()
        got, at = [], 0
        for n in recv_n.tolist():
            got.append(pickle.loads(out[at: at + n].numpy().tobytes()))
            at += n
        return got

    # ------------------------------------------------------------------ the roll call's messages

    def post(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        key = f"{self.name}/m/{tag}/{dest}"
        with contextlib.suppress(RuntimeError):  # the store is gone: the job is ending anyway
            i = self.store.add(f"{key}/n", 1)
            self.store.set(f"{key}/{i}", json.dumps({"src": self.rank, "obj": obj}))

    def take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        key = f"{self.name}/m/{tag}/{self.rank}"
        seen = self._seen.get(tag, 0)
        try:
            if self.store.add(f"{key}/n", 0) <= seen or not self.store.check([f"{key}/{seen + 1}"]):
                return None
            msg = json.loads(self.store.get(f"{key}/{seen + 1}"))
        except (RuntimeError, ValueError):
            return None
        self._seen[tag] = seen + 1
        obj = msg.get("obj") if isinstance(msg, dict) else None
        return int(msg.get("src", -1)), obj if isinstance(obj, dict) else {}

    def free(self) -> None:
        self._pg = None
