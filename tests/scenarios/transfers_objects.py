"""The protocol's object broadcast and gather between real MPI ranks: objects of a few bytes to
300 kB (a save's vote is about 3 kB), from every root, several gathers in a row with every rank
a different size, each as a tree collective and flat (point to point: a save's vote and outcome).
Every object must arrive whole and where it belongs. Flat gathers in a row, with the root the
last to arrive: the ranks' later objects are there before the root takes the first ones.

Run by tests/multirank/test_transfers.py.
"""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

from mpickpt.mpi import rollcall
from mpickpt.mpi.protocol import Protocol

proto = Protocol(timeout=60)
rank, size = proto.rank, proto.size
SLOT = 4096  # sizes around it: a fixed first chunk is how object collectives are often cut
FITS = SLOT - 8


def sized(n: int, tag: int) -> bytes:
    """An object whose pickle is ``n`` bytes (exactly, near the slot's size; about, far above
    it), told apart by ``tag``."""
    k = n - len(pickle.dumps(b""))
    while len(pickle.dumps(bytes([tag % 251]) * k)) > n:
        k -= 1
    obj = bytes([tag % 251]) * k
    assert len(pickle.dumps(obj)) == n or n > 2 * SLOT, (n, len(pickle.dumps(obj)))
    return obj


SIZES = [100, FITS, FITS + 1, 5 * SLOT + 3, 300_000]
checked = 0
for root, flat in [(r, f) for f in (False, True) for r in range(size)]:
    for i, n in enumerate(SIZES):
        obj = sized(n, root * 10 + i) if rank == root else None
        got = proto.bcast(obj, "bcast", root=root, flat=flat)
        assert got == sized(n, root * 10 + i), (root, n)
        checked += 1
    if flat and rank == root:  # the others' three gathers are sent before this one takes any
        time.sleep(0.5)
    for shift in range(3):  # every rank a different size, three gathers in a row
        mine = sized(SIZES[(rank + shift) % len(SIZES)], rank + shift)
        got = proto.gather(mine, "gather", root=root, flat=flat)
        if rank == root:
            assert got == [sized(SIZES[(r + shift) % len(SIZES)], r + shift)
                           for r in range(size)], (root, shift)
            checked += 1
        else:
            assert got is None
    got = proto.gather({"rank": rank, "deep": [rank] * rank}, "gather", root=root, flat=flat)
    if rank == root:
        assert got == [{"rank": r, "deep": [r] * r} for r in range(size)]
print(f"rank {rank}: {checked} objects whole", flush=True)

# flat, a rank that does not test (it naps, or computes) holds up no other rank: rank 3 has rank
# 0's broadcast, and rank 0 the gather, while rank 2 sleeps 3 s without a test (in a tree,
# rank 2 forwards rank 3's part of either)
if size >= 4:
    for what in ("broadcast", "gather"):
        proto.barrier("before")
        start = time.monotonic()
        req = (proto.comm.ibcast(b"outcome", 0, flat=True) if what == "broadcast"
               else proto.comm.igather(rank, 0, flat=True))
        if rank == 2:
            time.sleep(3)
        while not req.test():
            time.sleep(0.001)
        want = b"outcome" if what == "broadcast" else list(range(size)) if rank == 0 else None
        assert req.result() == want, (what, req.result())
        print(f"rank {rank}: flat {what} in {time.monotonic() - start:.2f} s", flush=True)

# the root comes last to three small flat gathers in a row: the later ones' messages wait for
# their own gather (MPI keeps each sender's messages in order)
proto.barrier("before")
if rank == 0:
    time.sleep(0.5)
for shift in range(3):
    got = proto.gather((rank, shift), "gather", root=0, flat=True)
    assert got == ([(r, shift) for r in range(size)] if rank == 0 else None), got
if rank == 0:
    print(f"rank 0: {proto.comm.flat.stashed} messages kept for a later gather", flush=True)

# a message that came while its receiver made no MPI call (a nap, a doze) is taken by the
# receiver's first test: the gather's on rank 0, the broadcast's on the others (after a nap,
# MPICH's first probe only takes in what arrived)
for what in ("broadcast", "gather"):
    proto.barrier("before")
    req = (proto.comm.ibcast(b"quiet", 0, flat=True) if what == "broadcast"
           else proto.comm.igather(rank, 0, flat=True))
    if (rank == 0) == (what == "gather"):
        time.sleep(0.5)
        print(f"rank {rank}: quiet {what}: first test {req.test()}", flush=True)
    while not req.test():
        time.sleep(0.001)

# rank 0's roll call takes in the answers that came while it made no MPI call without a nap
# between them (the ranks post theirs at once here, as if rank 0's call had reached them; on a
# communicator of its own, which rank 0's call and report leave unread)
proto.barrier("before")
roll = rollcall.RollCall(proto.comm.dup(), grace=10)
if rank != 0:
    roll.comm.post({"seq": 0, "where": "the test"}, 0, rollcall.TAG_HERE)
else:
    time.sleep(0.5)
    naps: list[float] = []
    clock = rollcall.time
    rollcall.time = SimpleNamespace(  # type: ignore[assignment]
        monotonic=time.monotonic, sleep=lambda s: naps.append(s) or time.sleep(s))
    try:
        said = roll.account()
    finally:
        rollcall.time = clock  # type: ignore[assignment]
    print(f"rank 0: roll call: {len(naps)} naps: {said}", flush=True)

# a rank out of step (rank 1 skips a gather the others start) raises, not takes another
# collective's object
proto.barrier("before")
if rank != 1:
    proto.comm.igather(b"skipped", 0, flat=True)  # never completes: rank 1 sends nothing
req = proto.comm.ibcast(b"next", 0, flat=True)
if rank == 1:
    start = time.monotonic()
    try:
        while not req.test() and time.monotonic() - start < 10:
            time.sleep(0.001)
        print("rank 1: out of step, and took the broadcast", flush=True)
    except Exception as e:
        print(f"rank 1: out of step: {type(e).__name__}: {e}", flush=True)
else:
    while not req.test():
        time.sleep(0.001)
