"""XOR over a ring of point-to-point transfers: a lost member's shard and parity rebuilt (a
team's parities are made by direct transfers, :mod:`mpickpt.local.xordirect`; the ring can make
them too, and its test does).

A block (one window of one parity position ``k``, see :mod:`mpickpt.local.topology`) is the
XOR of one contribution from every member but ``k``. It travels a chain around the team: the
member after ``k`` sends its contribution to the next, each next one XORs its own into what it
received and passes it on, and ``k`` (or a lost member, rebuilding) receives the whole. Every
message goes from team position ``i`` to ``i + 1``, in one order that every member follows, so
the blocks of all the chains can be in flight at once: each member sends and receives about
one shard's bytes in all, at the speed of a point-to-point transfer, and XORs them on its CPU
while the next blocks move. A rebuild's blocks all end at the lost member, which thus receives
one shard's bytes from its neighbour.

MPI's own XOR reductions are not used: MPICH's ``Reduce`` and ``Reduce_scatter_block`` with
``BXOR`` moved 0.25 GB/s between three ranks on a 2-core VM where a ``Send`` moved 5.8 GB/s and
numpy XORed 3.7 GB/s on one core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format import iothreads
from ..mpi.protocol import Pending, Protocol

DEPTH = 4  # blocks received ahead
BUFFERS = 2 * DEPTH  # buffers for the blocks passed on: receives stay posted while some go out
# bytes per block at most: a chain of n members fills in n - 1 of them (a lost node's 2 GB
# rebuilt on one H200 by three ranks: 1.5 s with 32 MiB blocks, 1.75-1.93 s with 8 MiB)
BLOCK = 32 << 20
XOR_THREADS = 4  # a block's XOR in this many pieces at once
XOR_PIECE = 1 << 20  # ... each of this many bytes at least


# a member's bytes of one block: ``(offset in the block, bytes)`` runs, zeros between them
Parts = list[tuple[int, np.ndarray]]


@dataclass(frozen=True)
class Block:
    """Bytes ``[off, off + n)`` of parity position ``k``'s chunk."""

    k: int
    off: int
    n: int


def blocks(positions: list[int], chunk: int, window: int) -> list[Block]:
    """The blocks of ``positions`` (in that order), at most ``window`` bytes each (and at
    most :data:`BLOCK`)."""
    window = min(window, BLOCK)
    return [Block(k, off, min(window, chunk - off)) for k in positions
            for off in range(0, chunk, window)]


def passing(buffer: Callable[[str, int], memoryview], window: int) -> list[np.ndarray]:
    """:data:`BUFFERS` reused buffers of ``window`` bytes (``buffer(name, nbytes)`` gives
    them), for the blocks a member passes on."""
    return [np.frombuffer(buffer(f"in{i}", window), dtype=np.uint8) for i in range(BUFFERS)]


def interleave(per_position: list[list[Block]]) -> list[Block]:
    """Blocks of several positions taken in turn, so that every chain has some in flight."""
    out: list[Block] = []
    for t in range(max(map(len, per_position), default=0)):
        out += [bs[t] for bs in per_position if t < len(bs)]
    return out


def xor_into(acc: np.ndarray, src: np.ndarray, threads: int = XOR_THREADS) -> None:
    """``acc ^= src`` (uint8 arrays of one length), 8 bytes at a time where both allow; a
    large block in ``threads`` pieces at once (numpy lets go of the GIL), since a member of
    the ring passes a block on only once it is XORed: one thread took 0.6 s of the 1.7 s a
    three-member parity of 2 GB shards took by the ring on an H200 host. (The parity beside
    training, :mod:`mpickpt.local.xordirect`, passes 1: see there.)"""
    n = acc.nbytes
    if n < XOR_PIECE * 2 or threads <= 1:
        _xor(acc, src)
        return
    step = (-(-n // threads) + 7) & ~7  # whole words, but for the last piece
    list(_xor_pool().map(lambda a: _xor(acc[a:a + step], src[a:a + step]), range(0, n, step)))


def _xor(acc: np.ndarray, src: np.ndarray) -> None:
    if not acc.nbytes % 8 and not acc.ctypes.data % 8 and not src.ctypes.data % 8:
        np.bitwise_xor(acc.view(np.uint64), src.view(np.uint64), out=acc.view(np.uint64))
    else:
        np.bitwise_xor(acc, src, out=acc)


def prestart() -> None:
    """The XOR's threads made now (:func:`mpickpt.format.iothreads.prestart`)."""
    iothreads.prestart(_xor_pool(), XOR_THREADS)


def _xor_pool() -> ThreadPoolExecutor:
    return iothreads.pool(XOR_THREADS, False, "xor")


def composed(out: np.ndarray, parts: Parts) -> np.ndarray:
    """``out`` (a block's length) filled with ``parts``' runs, zeros between them."""
    out[:] = 0
    for at, a in parts:
        out[at:at + a.nbytes] = a
    return out


def whole(parts: Parts, n: int) -> np.ndarray | None:
    """The block itself, where ``parts`` are one run of all its ``n`` bytes."""
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1].nbytes == n:
        return parts[0][1]
    return None


def ring(team: Protocol, order: list[Block], contribution: Callable[[Block], Parts],
         into: Callable[[Block], np.ndarray], buffers: list[np.ndarray], phase: str,
         on_block: Callable[[], None] = lambda: None, ends: Callable[[Block], int] | None = None
         ) -> None:
    """Move every block of ``order`` (the same list on every member) around the team: this
    member's ``contribution(b)`` (its runs of the block's bytes) goes in, the block that ends
    here lands in ``into(b)``.
    ``ends(b)``: the position a block ends at (``b.k`` unless given: a rebuild's lost member).
    ``buffers``: uint8 arrays of the largest block for the blocks this member passes on, at
    least :data:`DEPTH` (:func:`passing` gives :data:`BUFFERS`).
    Collective over ``team``; within its deadline. A member whose own bytes fail goes on all
    the same, with zeros or a scratch buffer from its callbacks, so that no other member waits
    for a block it would not send."""
    flow = _Flow(team, order, into, buffers, phase, ends or (lambda b: b.k))
    for t, b in enumerate(order):
        kind = flow.role(b)
        if kind == "start":
            parts = contribution(b)
            out, buf = whole(parts, b.n), None
            if out is None:
                out, buf = flow.composed(parts, b.n)
        else:
            flow.post(t)
            pending, out, buf = flow.posted.pop(t)
            pending.wait()
            if kind == "end":
                on_block()
                flow.post(None)
                continue
            for at, a in contribution(b):
                xor_into(out[at:at + a.nbytes], a)
        flow.send(out, buf)
        on_block()
        flow.post(None)
    while flow.sending:
        flow.send_done()


class _Flow:
    """One member's blocks in flight around the ring: the receives posted ahead, the sends
    under way, the pass buffers free."""

    def __init__(self, team: Protocol, order: list[Block], into: Callable[[Block], np.ndarray],
                 buffers: list[np.ndarray], phase: str, end: Callable[[Block], int]) -> None:
        n, me = team.size, team.rank
        self.team, self.order, self.into, self.phase, self.end = team, order, into, phase, end
        self.me, self.nxt, self.prev, self.n = me, (me + 1) % n, (me - 1) % n, n
        self.size = len(buffers[0])
        self.free = deque(buffers)
        self.sending: deque[tuple[Pending, np.ndarray | None]] = deque()
        self.posted: dict[int, tuple[Pending, np.ndarray, np.ndarray | None]] = {}
        self.coming = deque(t for t, b in enumerate(order) if self.role(b) != "start")

    def role(self, b: Block) -> str:
        """"start", "pass" or "end" of ``b``'s chain at this member."""
        last = self.end(b)
        return "end" if self.me == last else "start" if self.me == (last + 1) % self.n \
            else "pass"

    def send(self, out: np.ndarray, buf: np.ndarray | None) -> None:
        """``out`` to the next member; ``buf`` (its buffer) free again once it has gone."""
        self.sending.append((self.team.start([(out, self.nxt)], [], self.phase), buf))
        while len(self.sending) > DEPTH:
            self.send_done()

    def send_done(self) -> None:
        pending, buf = self.sending.popleft()
        pending.wait()
        if buf is not None:
            self.free.append(buf)

    def reclaim(self) -> None:
        """Buffers of blocks gone out, taken back without waiting."""
        while not self.free and self.sending and self.sending[0][0].done():
            self.send_done()

    def post(self, needed: int | None) -> None:
        """Receives posted ahead, up to :data:`DEPTH`; block ``needed``'s at least."""
        coming = self.coming
        while coming and (len(self.posted) < DEPTH or coming[0] == needed):
            t = coming[0]
            b = self.order[t]
            buf = None
            if self.role(b) == "pass":
                self.reclaim()
                if not self.free:
                    if t != needed or not self.sending:
                        return
                    self.send_done()  # its buffer: one that went out before
                    continue
                buf = self.free.popleft()
                target = buf[:b.n]
            else:
                target = self.into(b)
            self.posted[t] = (self.team.start([], [(target, self.prev)], self.phase), target,
                              buf)
            coming.popleft()

    def composed(self, parts: Parts, n: int) -> tuple[np.ndarray, np.ndarray]:
        """A block that starts here, of several runs: put together in a buffer of its own.
        Never a wait for one: the next member may be waiting for a block this one passes on;
        a buffer made instead joins the others once its block has gone."""
        self.reclaim()
        buf = self.free.popleft() if self.free else np.empty(max(self.size, n), np.uint8)
        return composed(buf[:n], parts), buf
