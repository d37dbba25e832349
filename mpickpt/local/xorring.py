"""XOR parity over a ring of point-to-point transfers: the team's parities when saving, a lost
member's shard and parity when rebuilding.

A block (one window of one parity position ``k``, see :mod:`mpickpt.local.topology`) is the
XOR of one contribution from every member but ``k``. It travels a chain around the team: the
member after ``k`` sends its contribution to the next, each next one XORs its own into what it
received and passes it on, and ``k`` (or a lost member, rebuilding) receives the whole. Every
message goes from team position ``i`` to ``i + 1``, in one order that every member follows, so
the blocks of all the chains can be in flight at once: each member sends and receives about
one shard's bytes in all, at the speed of a point-to-point transfer, and XORs them on its CPU
while the next blocks move.

MPI's own XOR reductions are not used: MPICH's ``Reduce`` and ``Reduce_scatter_block`` with
``BXOR`` moved 0.25 GB/s between three ranks on a 2-core VM where a ``Send`` moved 5.8 GB/s and
numpy XORed 3.7 GB/s on one core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..mpi.protocol import Pending, Protocol

DEPTH = 4  # blocks received ahead
BUFFERS = 2 * DEPTH  # buffers for the blocks passed on: receives stay posted while some go out
# bytes per block at most: a chain of n members fills in n - 1 of them (a lost node's 2 GB
# rebuilt on one H200 by three ranks: 1.5 s with 32 MiB blocks, 1.75-1.93 s with 8 MiB)
BLOCK = 32 << 20


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


def xor_into(acc: np.ndarray, src: np.ndarray) -> None:
    """``acc ^= src`` (uint8 arrays of one length), 8 bytes at a time where both allow."""
    if not acc.nbytes % 8 and not acc.ctypes.data % 8 and not src.ctypes.data % 8:
        np.bitwise_xor(acc.view(np.uint64), src.view(np.uint64), out=acc.view(np.uint64))
    else:
        np.bitwise_xor(acc, src, out=acc)


def ring(team: Protocol, order: list[Block], contribution: Callable[[Block], np.ndarray],
         into: Callable[[Block], np.ndarray], buffers: list[np.ndarray], phase: str,
         on_block: Callable[[], None] = lambda: None, ends: Callable[[Block], int] | None = None
         ) -> None:
    """Move every block of ``order`` (the same list on every member) around the team: this
    member's ``contribution(b)`` goes in, the block that ends here lands in ``into(b)``.
    ``ends(b)``: the position a block ends at (``b.k`` unless given: a rebuild's lost member).
    ``buffers``: uint8 arrays of the largest block for the blocks this member passes on, at
    least :data:`DEPTH` (:func:`passing` gives :data:`BUFFERS`).
    Collective over ``team``; within its deadline. A member whose own bytes fail goes on all
    the same, with zeros or a scratch buffer from its callbacks, so that no other member waits
    for a block it would not send."""
    n, me = team.size, team.rank
    nxt, prev = (me + 1) % n, (me - 1) % n
    end = ends or (lambda b: b.k)

    def role(b: Block) -> str:  # "start", "pass" or "end" of b's chain at this member
        last = end(b)
        return "end" if me == last else "start" if me == (last + 1) % n else "pass"

    free = deque(buffers)
    sending: deque[tuple[Pending, np.ndarray | None]] = deque()
    posted: dict[int, tuple[Pending, np.ndarray, np.ndarray | None]] = {}
    coming = deque(t for t, b in enumerate(order) if role(b) != "start")

    def send_done() -> None:
        pending, buf = sending.popleft()
        pending.wait()
        if buf is not None:
            free.append(buf)

    def post(needed: int | None) -> None:
        """Receives posted ahead, up to :data:`DEPTH`; block ``needed``'s at least."""
        while coming and (len(posted) < DEPTH or coming[0] == needed):
            t = coming[0]
            b = order[t]
            buf = None
            if role(b) == "pass":
                while not free and sending and sending[0][0].done():
                    send_done()  # buffers of blocks gone out, taken back without waiting
                if not free:
                    if t != needed or not sending:
                        return
                    send_done()  # its buffer: one that went out before
                    continue
                buf = free.popleft()
                target = buf[:b.n]
            else:
                target = into(b)
            posted[t] = (team.start([], [(target, prev)], phase), target, buf)
            coming.popleft()

    for t, b in enumerate(order):
        kind = role(b)
        if kind == "start":
            out, buf = contribution(b), None
        else:
            post(t)
            pending, out, buf = posted.pop(t)
            pending.wait()
            if kind == "end":
                on_block()
                post(None)
                continue
            xor_into(out, contribution(b))
        sending.append((team.start([(out, nxt)], [], phase), buf))
        while len(sending) > DEPTH:
            send_done()
        on_block()
        post(None)
    while sending:
        send_done()
