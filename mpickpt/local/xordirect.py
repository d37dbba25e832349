"""A team's XOR parity by direct transfers: every member sends each other member its
contribution to that member's parity, and XORs the ones it receives for its own.

The ring (:mod:`mpickpt.local.xorring`) passes a block from member to member, so a block
is complete only after ``len(team) - 1`` transfers one after another, each waiting for the
XOR before it. Here every contribution goes straight to the member whose parity it is part
of: the same bytes per member (its shard out, a shard's worth in), but no chain, so all of a
round's transfers move at once and the XOR runs on the receiving member only, beside the next
round's transfers. The first contribution of a block is received straight into its place in
the parity; the others into reused buffers, XORed in once they are in, on this thread alone:
the parity runs while the job trains, and with each block's XOR split over four threads of
its own (:func:`~mpickpt.local.xorring.xor_into`'s default) three ranks sharing an H200 lost a
training step of +90 ms per save (+3.3 % at a save every 20 steps) against +0.5 % so, and were
protected as soon (1.10x against 1.12x the slowest bound; ``docs/performance.md``).

A rebuild still goes around the ring: there every block ends at one member, which a ring
feeds with one shard's bytes where direct transfers would feed it ``len(team) - 1``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..mpi.protocol import Pending, Protocol
from .xorring import BLOCK, BUFFERS, Block, Parts, composed, whole, xor_into

AHEAD = 2  # rounds in flight: the XOR of one beside the transfers of the next
MIN_BLOCK = 1 << 20


def block_bytes(team: int, window: int) -> int:
    """The bytes of a round's blocks: at most ``window`` and :data:`~mpickpt.local.xorring.BLOCK`,
    and fewer in a larger team, so that the buffers of the rounds in flight stay within about
    the exchange's :data:`~mpickpt.local.xorring.BUFFERS` of them: a round takes a buffer for
    each contribution after the first it receives (``team - 2``) and for each block it sends
    that is not one run of the snapshot (up to ``team - 1``). Never above ``window``, nor
    below :data:`MIN_BLOCK` unless ``window`` is."""
    cap = min(window, BLOCK)
    fits = BUFFERS * cap // (AHEAD * max(1, 2 * team - 3))
    return cap if fits >= cap else min(cap, max(MIN_BLOCK, fits // 65536 * 65536))


# one round: ``(member, block)`` pairs, the member sending its contribution to the block's
# position; every member's list of rounds is the same
Round = list[tuple[int, Block]]


def rounds(n: int, chunk: int, window: int) -> list[Round]:
    """Every member sends one block of each of its chunks in every round, so that each
    member receives from every other one in every round. (Rounds in the order of each
    member's shard file instead, its first chunk's blocks first, as its snapshot lands them,
    took 1.55-1.59 s to protect 2 GB shards on one H200 shared by three ranks, against
    1.36 s: in such a round every member sends to one of two positions.)"""
    return [[(j, Block(k, off, min(window, chunk - off))) for j in range(n) for k in range(n)
             if k != j] for off in range(0, chunk, window)]


class _Round:
    """One round in flight on this member: its transfers, the received contributions to
    XOR in (``(block, buffer)``), the buffers it took."""

    def __init__(self, pending: Pending, xors: list[tuple[Block, np.ndarray]],
                 used: list[np.ndarray], blocks: int) -> None:
        self.pending, self.xors, self.used, self.blocks = pending, xors, used, blocks


def direct(team: Protocol, chunk: int, window: int, contribution: Callable[[Block], Parts],
           into: Callable[[Block], np.ndarray], buffers: list[np.ndarray], phase: str,
           on_block: Callable[[], None] = lambda: None) -> None:
    """This member's parity, ``chunk`` bytes in blocks of ``window``: each of its blocks
    lands in ``into(b)``, the XOR of every other member's ``contribution(b)`` (its runs of
    the block's bytes, zeros between them); this member's contributions go to the others.
    ``buffers``: reused uint8 arrays of ``window`` bytes at least (more are made if a round
    needs them, and used again until the call returns: :func:`block_bytes` keeps them few).
    Collective over ``team``; within its deadline. A member whose own bytes fail goes on
    with zeros from its callback, so that no other member waits for a block."""
    me, n = team.rank, team.size
    free = list(buffers)

    def take() -> np.ndarray:
        return free.pop() if free else np.empty(window, np.uint8)

    def post(rnd: Round) -> _Round:
        recvs, xors, used = [], [], []
        for j, b in rnd:  # a round has every contribution to this member's block
            if b.k != me:
                continue
            if recvs:  # the first lands in place, the others are XORed in after
                buf = take()
                used.append(buf)
                xors.append((b, buf[:b.n]))
                recvs.append((buf[:b.n], j))
            else:
                recvs.append((into(b), j))
        sends = []
        for j, b in rnd:
            if j != me:
                continue
            parts = contribution(b)
            out = whole(parts, b.n)
            if out is None:
                buf = take()
                used.append(buf)
                out = composed(buf[:b.n], parts)
            sends.append((out, b.k))
        return _Round(team.start(sends, recvs, phase), xors, used, len(recvs))

    def finish(r: _Round) -> None:
        r.pending.wait()
        for b, buf in r.xors:
            xor_into(into(b), buf, threads=1)
        free.extend(r.used)
        for _ in range(r.blocks):
            on_block()

    flight: list[_Round] = []
    for rnd in rounds(n, chunk, window):
        flight.append(post(rnd))
        if len(flight) > AHEAD:
            finish(flight.pop(0))
    for r in flight:
        finish(r)
