"""Flat object collectives over MPI: a gather and a broadcast point to point (a save's vote and
its outcome).

Each rank's message goes straight to the root, or the root's straight to each rank, received by
a matched probe at whatever size it has. A tree collective completes only as fast as its inner
ranks test it, to forward their children's part, and a rank that waits for a commit naps: on 4
ranks of 2 cores saving 1.7 MB every step, rank 0 waited 35 ms for a vote whose shards were
written in 8, rank 2 forwarding rank 3's entry between its naps. A gather's root receives one
message per rank in any case; a flat broadcast's root sends P - 1 instead of about log2 P, so
:class:`~mpickpt.mpi.mpicomm.MpiComm` broadcasts flat only up to :data:`BCAST_RANKS` ranks.

Every message carries the number of flat collectives its sender has started on this
communicator: a rank out of step (one that skipped a collective the others ran) raises
:class:`~mpickpt.mpi.comm.CommError` rather than take another collective's object.
"""

from __future__ import annotations

import pickle
from typing import Any

from mpi4py import MPI

from .comm import CommError

# tags of the flat collectives' messages (the roll call's are 0x6D71-0x6D74; the node-local
# level's shard copies 0x6D80)
TAG_GATHER, TAG_BCAST = 0x6D75, 0x6D76
PROBES = 4  # matched probes a test tries before it takes none (see probe(): on this VM, 16
# ranks, MPICH took in the next message after 1 empty probe in 93 % of 450, 2 in 6 %, 3 or 4
# in 1 %; a probe costs 0.3 us)
BCAST_RANKS = 256  # past this many ranks a broadcast is a tree again (root sends P - 1 flat)

Early = tuple[int, Any, bytearray]  # (source, receive request, buffer)


def comm_error(e: Any) -> CommError:
    """An mpi4py ``MPI.Exception`` as the protocol's :class:`CommError` (also
    :mod:`mpickpt.mpi.mpicomm`'s)."""
    return CommError(f"MPI reported: {e.Get_error_string().strip()}")


class Flat:
    """The flat collectives of one communicator: how many were started, and the messages of a
    later gather that came before its root took those of the current one (MPI keeps each
    sender's messages in order, so a second one from the same rank is the next gather's)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.started = 0
        self.early: list[Early] = []
        self.stashed = 0  # messages kept for a later gather (a statistic, for the tests)
        self.sending: list[Any] = []  # sends not known to be done (they keep their buffers):
        # a gather's, whose senders go on at once whatever MPI's eager limit (Open MPI's shared
        # memory: 4 kB, beyond which a send waits for its receiver; the root's outcome answers
        # them anyway), and the roll call's posts (MpiComm.post)

    def sent(self, req: Any) -> None:
        """Keep ``req`` (a send nobody waits for) until it is done; forget those that are."""
        self.sending = [r for r in self.sending if not r.Test()] + [req]

    def gather(self, obj: Any, root: int) -> FlatGather:
        self.started += 1
        return FlatGather(self, obj, root, self.started)

    def bcast(self, obj: Any, root: int) -> FlatBcast:
        self.started += 1
        return FlatBcast(self, obj, root, self.started)


def probe(comm: Any, source: int, tag: int, status: Any) -> Any:
    """A matched probe for a message, tried up to :data:`PROBES` times: a probe of MPICH's that
    finds nothing takes in at most one message that arrived (shared memory: one a progress
    poll), for the next probe to match; Open MPI's takes in all of them. A rank that tests
    between naps found one message a test, a nap behind its outcome, the vote's root one rank's
    entry a nap, and the roll call two answers a nap (:meth:`~.mpicomm.MpiComm.take`)."""
    for _ in range(PROBES):
        if (msg := comm.Improbe(source, tag, status)) is not None:
            return msg
    return None


def _unpickle(buf: bytearray, src: int, seq: int, what: str) -> Any:
    got, obj = pickle.loads(buf)
    if got != seq:
        raise CommError(f"rank {src}'s message is of flat collective #{got}, not #{seq} ({what}):"
                        " the ranks are out of step")
    return obj


class FlatGather:
    """Every other rank's pickled object sent to the root; the root receives them as they
    come, in any order. A sender is done once its send is started (:meth:`Flat.sent`)."""

    __slots__ = ("flat", "got", "left", "mine", "recvs", "seq")

    def __init__(self, flat: Flat, obj: Any, root: int, seq: int) -> None:
        comm = flat.comm
        self.flat, self.seq = flat, seq
        self.mine = comm.Get_rank() == root
        self.got: list[Any] = [None] * comm.Get_size()
        self.recvs: list[Early] = []
        self.left: set[int] = set()
        try:
            if not self.mine:  # sent, and done here (the request kept until it completes)
                flat.sent(comm.Isend([pickle.dumps((seq, obj)), MPI.BYTE], root, TAG_GATHER))
        except MPI.Exception as e:
            raise comm_error(e) from None
        if self.mine:
            self.got[root] = obj
            self.left = set(range(comm.Get_size())) - {root}
            for item in list(flat.early):  # each sender's first: this gather's
                if item[0] in self.left:
                    flat.early.remove(item)
                    self._take(item)

    def _take(self, item: Early) -> None:
        self.left.discard(item[0])
        self.recvs.append(item)

    def test(self) -> bool:
        if not self.mine:
            return True
        try:
            status = MPI.Status()
            while self.left and (msg := probe(self.flat.comm, MPI.ANY_SOURCE, TAG_GATHER,
                                              status)):
                buf = bytearray(status.Get_count(MPI.BYTE))
                item = (status.Get_source(), msg.Irecv([buf, MPI.BYTE]), buf)
                if item[0] in self.left:
                    self._take(item)
                else:
                    self.flat.early.append(item)
                    self.flat.stashed += 1
            still = []
            for src, req, buf in self.recvs:
                if req.Test():
                    self.got[src] = _unpickle(buf, src, self.seq, "a gather")
                else:
                    still.append((src, req, buf))
            self.recvs = still
        except MPI.Exception as e:
            raise comm_error(e) from None
        return not self.left and not self.recvs

    def result(self) -> Any:
        return self.got if self.mine else None


class FlatBcast:
    """The root's pickled object sent to every other rank."""

    __slots__ = ("flat", "obj", "recv", "root", "sends", "seq")
    direct = True  # a receiver's tests hold up no other rank (Protocol.bcast's idle waits)

    def __init__(self, flat: Flat, obj: Any, root: int, seq: int) -> None:
        comm = flat.comm
        self.flat, self.root, self.seq, self.obj = flat, root, seq, obj
        self.recv: tuple[Any, bytearray] | None = None
        self.sends: list[Any] = []
        if comm.Get_rank() == root:
            data = pickle.dumps((seq, obj))
            try:
                self.sends = [comm.Isend([data, MPI.BYTE], r, TAG_BCAST)
                              for r in range(comm.Get_size()) if r != root]
            except MPI.Exception as e:
                raise comm_error(e) from None

    def test(self) -> bool:
        comm = self.flat.comm
        try:
            if comm.Get_rank() == self.root:
                return bool(MPI.Request.Testall(self.sends))
            if self.recv is None:
                status = MPI.Status()
                msg = probe(comm, self.root, TAG_BCAST, status)
                if msg is None:
                    return False
                buf = bytearray(status.Get_count(MPI.BYTE))
                self.recv = (msg.Irecv([buf, MPI.BYTE]), buf)
            if not self.recv[0].Test():
                return False
        except MPI.Exception as e:
            raise comm_error(e) from None
        self.obj = _unpickle(self.recv[1], self.root, self.seq, "a broadcast")
        return True

    def result(self) -> Any:
        return self.obj
