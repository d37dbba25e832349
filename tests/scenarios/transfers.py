"""Point-to-point transfers received in groups a few at a time (``Protocol.start_grouped``): two
ranks each send the other 10 groups of two buffers and receive 10, with 3 groups ahead. Every
byte must arrive where it was asked for, each group's wait must mean that group is in, and no
more than 3 groups may be posted and not yet complete at any time (posted all at once, MPI moves
them side by side and the first is in only near the end of all).

Run by tests/multirank/test_transfers.py.
"""

from __future__ import annotations

import threading

import numpy as np

from mpickpt.mpi.protocol import Protocol

GROUPS, AHEAD, MIB = 10, 3, 1 << 20
proto = Protocol(timeout=60)
peer = 1 - proto.rank
sizes = [MIB * (k % 3 + 1) + 7 * k for k in range(GROUPS)]


def value(rank: int, k: int, j: int) -> int:
    return (rank * 97 + k * 2 + j) % 251 + 1


# each rank's own window: the groups it has posted and the ones complete, as they happen
lock, posted, done, worst = threading.Lock(), [0], [0], [0]
irecv, waitall = proto.comm.irecv, proto.comm.waitall


def counted_irecv(buf, src, tag):  # type: ignore[no-untyped-def]
    with lock:
        if id(buf) in first_of_group:
            posted[0] += 1
            worst[0] = max(worst[0], posted[0] - done[0])
    return irecv(buf, src, tag)


def counted_waitall(reqs):  # type: ignore[no-untyped-def]
    error = waitall(reqs)
    with lock:
        done[0] += 1  # (the sends' wait comes last, after every group's)
    return error


bufs = [[np.zeros(n, np.uint8) for _ in range(2)] for n in sizes]
first_of_group = {id(g[0]) for g in bufs}
sends = [(np.full(n, value(proto.rank, k, j), np.uint8), peer)
         for k, n in enumerate(sizes) for j in range(2)]
proto.comm.irecv, proto.comm.waitall = counted_irecv, counted_waitall
pending = proto.start_grouped(sends, [[(b, peer) for b in g] for g in bufs], "test", ahead=AHEAD)
for k in range(GROUPS):
    pending[k].wait()
    for j in range(2):
        want = value(peer, k, j)
        assert (bufs[k][j] == want).all(), f"rank {proto.rank}: group {k} buffer {j} not in"
pending[-1].wait()
assert posted[0] == GROUPS, (posted[0], GROUPS)
assert 1 <= worst[0] <= AHEAD, f"rank {proto.rank}: {worst[0]} groups in flight at once"
print(f"rank {proto.rank}: {GROUPS} groups in, at most {worst[0]} in flight", flush=True)
