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

# flat, a rank that does not test (it naps, or computes) holds up no other rank's broadcast;
# in a tree, rank 2 forwards rank 3's part of a broadcast from rank 0
proto.barrier("before")
if size >= 4:
    start = time.monotonic()
    req = proto.comm.ibcast(b"outcome", 0, flat=True)
    if rank == 2:
        time.sleep(3)
    while not req.test():
        time.sleep(0.001)
    assert req.result() == b"outcome"
    print(f"rank {rank}: flat broadcast in {time.monotonic() - start:.2f} s", flush=True)
proto.free()
