"""XOR parity by direct transfers (``mpickpt.local.xordirect``) and around the ring
(``mpickpt.local.xorring``), against numpy: the ranks of the job
form one team; each holds a shard of its own length (some not a multiple of 8, so that blocks
start at odd addresses), with stretches of zeros; some blocks' contributions come as runs with
the zeros left out, the way a snapshot's tensors give them. Every member's parity is made
by direct transfers into a buffer full of old bytes (a recycled parity file), with one reused
buffer where a round needs more, and again in blocks of 4 MiB, XORed on the calling thread
(no helper thread of the XOR's may start: the parity runs beside training); then around the
ring, in blocks of 1000 bytes (a chunk takes several); then, for every position in turn, the
ring rebuilds that member's chunks and parity from the others. Every byte must be the XOR
numpy gives.

Run by tests/multirank/test_transfers.py.
"""

from __future__ import annotations

import threading

import numpy as np

from mpickpt.local import xordirect, xorring
from mpickpt.local.topology import xor_chunk, xor_chunk_bytes
from mpickpt.mpi.protocol import Protocol

BLOCK = 1000
proto = Protocol(timeout=60)
n, me = proto.size, proto.rank
sizes = [5003 + 1811 * r for r in range(n)]
shards = [np.random.default_rng(r).integers(0, 256, s, dtype=np.uint8) for r, s in enumerate(sizes)]
for s in shards:  # stretches of zeros, which a member's runs leave out
    s[300:900] = 0
    s[2100:2500] = 0
chunk = xor_chunk_bytes(max(sizes), n)


def piece(r: int, start: int, length: int) -> np.ndarray:
    """Bytes of rank r's shard, zeros past its end."""
    out = np.zeros(length, np.uint8)
    have = max(0, min(length, sizes[r] - start))
    out[:have] = shards[r][start:start + have]
    return out


def contribution_of(r: int, parity: list[np.ndarray]) -> object:
    def contribution(b: xorring.Block) -> xorring.Parts:
        if r == b.k:  # rebuilding: a member's parity takes the place of its chunk
            return [(0, parity[r][b.off:b.off + b.n])]
        whole = piece(r, xor_chunk(n, r, b.k) * chunk + b.off, b.n)
        if b.off % 2000:  # runs with zeros left out between them, as a snapshot gives them
            return [(at, whole[at:at + 97]) for at in range(0, b.n, 97) if whole[at:at + 97].any()]
        return [(0, whole)]
    return contribution


def passing() -> list[np.ndarray]:
    return [np.zeros(BLOCK, np.uint8) for _ in range(xorring.DEPTH)]


want = [np.bitwise_xor.reduce([piece(j, xor_chunk(n, j, k) * chunk, chunk)
                               for j in range(n) if j != k]) for k in range(n)]
mine = np.full(chunk, 0xAB, np.uint8)  # a recycled parity file's old bytes
xordirect.direct(proto, chunk, BLOCK, contribution_of(me, []), lambda b: mine[b.off:b.off + b.n],
                 [np.zeros(BLOCK, np.uint8)], "test direct parity")
assert (mine == want[me]).all(), f"rank {me}: direct parity differs"

# blocks large enough that xorring.xor_into would split them over its own threads: the parity,
# made while the job trains, XORs them on this thread (docs/performance.md: a training step
# of +90 ms per save otherwise), and comes out the same
BIG = 4 << 20
big = [np.random.default_rng(10 + r).integers(0, 256, 3 * BIG + 8 * r + 3, dtype=np.uint8)
       for r in range(n)]
big_chunk = xor_chunk_bytes(max(b.nbytes for b in big), n)


def big_piece(r: int, start: int, length: int) -> np.ndarray:
    out = np.zeros(length, np.uint8)
    have = max(0, min(length, big[r].nbytes - start))
    out[:have] = big[r][start:start + have]
    return out


big_mine = np.full(big_chunk, 0x5A, np.uint8)
xordirect.direct(proto, big_chunk, BIG,
                 lambda b: [(0, big_piece(me, xor_chunk(n, me, b.k) * big_chunk + b.off, b.n))],
                 lambda b: big_mine[b.off:b.off + b.n],
                 [np.zeros(BIG, np.uint8) for _ in range(xorring.BUFFERS)], "test big parity")
assert (big_mine == np.bitwise_xor.reduce([big_piece(j, xor_chunk(n, j, me) * big_chunk, big_chunk)
                                           for j in range(n) if j != me])).all(), \
    f"rank {me}: direct parity of large blocks differs"
helpers = [t.name for t in threading.enumerate() if t.name.startswith("mpickpt-xor")]
assert not helpers, f"rank {me}: the parity XORed on threads of its own: {helpers}"
print(f"rank {me}: direct ok", flush=True)
mine = np.zeros(chunk, np.uint8)
order = xorring.interleave([xorring.blocks([k], chunk, BLOCK) for k in range(n)])
assert len(order) == n * -(-chunk // BLOCK)
xorring.ring(proto, order, contribution_of(me, []), lambda b: mine[b.off:b.off + b.n],
             passing(), "test parity")
assert (mine == want[me]).all(), f"rank {me}: parity differs"

for lost in range(n):  # every member lost in turn: its chunks and parity come back
    shard = np.zeros((n - 1) * chunk, np.uint8)
    par = np.zeros(chunk, np.uint8)

    def into(b: xorring.Block, lost: int = lost, shard: np.ndarray = shard,
             par: np.ndarray = par) -> np.ndarray:
        if b.k == lost:
            return par[b.off:b.off + b.n]
        start = xor_chunk(n, lost, b.k) * chunk + b.off
        return shard[start:start + b.n]

    rest = sorted((k for k in range(n) if k != lost), key=lambda k: xor_chunk(n, lost, k))
    xorring.ring(proto, xorring.blocks([*rest, lost], chunk, BLOCK),
                 contribution_of(me, want), into, passing(), "test rebuild",
                 ends=lambda _, lost=lost: lost)
    if me == lost:
        assert (shard[:sizes[me]] == shards[me]).all(), f"rank {me}: shard not rebuilt"
        assert not shard[sizes[me]:].any()
        assert (par == want[me]).all(), f"rank {me}: parity not rebuilt"
print(f"rank {me}: ring ok", flush=True)
