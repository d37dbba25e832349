"""What the protocol's messages travel over: MPI, or torch.distributed's gloo without MPI.

:class:`Comm` is the small set of operations the protocol layer needs (non-blocking barrier and
reductions, point-to-point buffers, object collectives that are started and then polled, the roll
call's side messages). :mod:`mpickpt.mpi.mpicomm` implements it over mpi4py,
:mod:`mpickpt.mpi.torchcomm` over process groups of gloo of mpickpt's own, built from the
launcher's rendezvous store (never the training's group); :mod:`mpickpt.mpi.backend` picks one.
"""

from __future__ import annotations

from typing import Any, Protocol


class CommError(RuntimeError):
    """A transfer failed (a peer died, a connection broke): the communicator is unusable."""


class Request(Protocol):
    def test(self) -> bool:
        """Whether it completed; raises :class:`CommError` if it failed."""
        ...


class ObjectRequest(Request, Protocol):
    def result(self) -> Any:
        """Once :meth:`test` said True: what the collective gave this rank."""
        ...


class Comm(Protocol):
    """A group of ranks and the operations of the protocol layer on it (see the module)."""

    rank: int
    size: int

    def dup(self) -> Comm: ...
    def split(self, color: int, key: int) -> Comm: ...
    def node_keys(self) -> list[tuple[int, str]]:
        """Collective: for every rank, (the lowest rank sharing its node's memory, host name)."""
        ...
    def ibarrier(self) -> Request: ...
    def iallreduce(self, send: Any, recv: Any, op: str) -> Request:
        """``op``: "min", "max" or "sum" over int64 arrays."""
        ...
    def isend(self, buf: Any, dest: int, tag: int) -> Request: ...
    def irecv(self, buf: Any, source: int, tag: int) -> Request: ...
    def waitall(self, reqs: list[Any]) -> str | None:
        """Block until every request ends; the error's text, or None."""
        ...
    def allgather(self, obj: Any) -> list[Any]:
        """Blocking: for setting up (node discovery, splits), not the protocol's phases."""
        ...
    def ibcast(self, obj: Any, root: int, flat: bool = False) -> ObjectRequest:
        """``flat``: point to point from the root, where the backend has it (MPI's)."""
        ...
    def igather(self, obj: Any, root: int, flat: bool = False) -> ObjectRequest:
        """Its result: every rank's object on ``root``, None elsewhere. ``flat``: point to
        point to the root, where the backend has it (MPI's)."""
        ...
    def iallgather(self, obj: Any) -> ObjectRequest: ...
    def ialltoall(self, objs: list[Any]) -> ObjectRequest:
        """``objs[r]`` to rank r; its result: what every rank sent this one, by rank."""
        ...
    def post(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        """A small message to ``dest``, never waited on (a dead peer never receives it)."""
        ...
    def take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        """A message of ``tag`` from any rank that has arrived: (source, message), or None."""
        ...
    def free(self) -> None: ...
