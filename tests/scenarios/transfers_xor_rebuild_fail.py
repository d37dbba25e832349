"""An XOR rebuild whose lost member cannot make its files (``parity.xor_rebuild``): three
ranks, one team, shards of 6 MB moved in blocks of 1 MiB (too large for MPI to send them before
their receive is posted). Rank 1, the lost member, is given a shard path in a directory that
does not exist: it must still take every block (into a scratch buffer), so that the survivors'
sends complete and they return at once, and then raise the error. The protocol's deadline is
20 s: a survivor left waiting for its blocks to go would raise ``CollectiveTimeout`` there.

``transfers_xor_rebuild_fail.py DIR``. Run by tests/multirank/test_transfers.py.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from mpickpt.local.parity import xor_rebuild
from mpickpt.local.topology import xor_chunk, xor_chunk_bytes
from mpickpt.mpi.protocol import Protocol

proto = Protocol(timeout=20)
n, me, lost = proto.size, proto.rank, 1
d = sys.argv[1]
sizes = [6_000_000 + 4099 * r for r in range(n)]
chunk = xor_chunk_bytes(max(sizes), n)
shards = [np.random.default_rng(r).integers(0, 256, s, dtype=np.uint8) for r, s in enumerate(sizes)]


def padded(r: int, start: int) -> np.ndarray:
    out = np.zeros(chunk, np.uint8)
    have = max(0, min(chunk, sizes[r] - start))
    out[:have] = shards[r][start:start + have]
    return out


own, parity = os.path.join(d, f"shard-{me}"), os.path.join(d, f"parity-{me}")
if me != lost:
    shards[me].tofile(own)
    np.bitwise_xor.reduce([padded(j, xor_chunk(n, j, me) * chunk) for j in range(n)
                           if j != me]).tofile(parity)
bufs: dict[str, np.ndarray] = {}


def buffer(name: str, nbytes: int) -> memoryview:
    if name not in bufs or bufs[name].nbytes < nbytes:
        bufs[name] = np.zeros(nbytes, np.uint8)
    return memoryview(bufs[name])[:nbytes]


t = time.monotonic()
try:
    xor_rebuild(proto, lost, chunk, sizes, own, parity,
                         os.path.join(d, "missing", "shard"), os.path.join(d, "missing", "par"),
                         1 << 20, buffer)
    outcome = "returned"
except OSError as e:
    outcome = f"OSError {e.strerror}"
print(f"rank {me}: {outcome} after {time.monotonic() - t:.1f} s", flush=True)
