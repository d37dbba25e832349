"""Landing: a snapshot's device staging buffers emptied into its host buffer, and how far that has
got, so that the shard's writer can write each block as soon as its bytes are in host memory.

The persist thread empties the staging buffers (:func:`unstage`) piece by piece and says after
each piece that it has landed (:meth:`Landing.mark`); the I/O threads, writing the shard's
blocks in the host buffer's order, wait in :meth:`Landing.gate` until the block they are about to
hash and write has landed. The pieces go in address order unless a consumer asks for some first
(:meth:`Landing.prefer`: the XOR parity, whose rounds take a block from each chunk of the shard at
once), at any time while they go. While the job trains, emptying 5.84 GB took 0.4-2.8 s on an H100
(0.14-0.26 s with the loop stopped), and the write after it as long again: one after the other,
they made a save's persist twice the disk's bound.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator

import torch

from ..errors import CheckpointError
from ..format.hostcopy import host_copy

# The staging->host copy goes in pieces of this size, at most D2H_DEPTH queued at a time.
D2H_CHUNK = 4 << 20
D2H_DEPTH = 1


class Landing:
    """Which bytes of each range ``[lo, hi)`` of a host buffer at address ``base``, filled from
    a staging buffer, have landed; bytes outside those ranges are there already."""

    def __init__(self, base: int, ranges: list[tuple[int, int]]) -> None:
        self.base, self.ranges = base, ranges
        self._have: list[list[tuple[int, int]]] = [[] for _ in ranges]  # landed, merged
        self._lock = threading.Lock()
        # each gate waiting: its offsets and the event that wakes it once they have landed
        # (woken all at once on every piece, eight writers took the GIL ~1,400 times each
        # for a 5.84 GB save, beside the training thread)
        self._waiters: list[tuple[int, int, threading.Event]] = []
        self._error: BaseException | None = None
        self._done = False
        self._wanted: list[tuple[int, int]] = []  # offsets to land first, in order (prefer)
        self._version = 0

    def mark(self, k: int, a: int, b: int) -> None:
        """Offsets ``[a, b)`` of range ``k`` have landed."""
        with self._lock:
            _merge(self._have[k], a, b)
            ready = [w for w in self._waiters if self._landed(w[0], w[1])]
            if ready:
                self._waiters = [w for w in self._waiters if w not in ready]
        for _, _, ev in ready:
            ev.set()

    def prefer(self, spans: list[tuple[int, int]]) -> None:
        """Land the bytes at these addresses ``[addr, end)`` first, in this order (what has
        not gone yet; the pieces :meth:`pieces` gives from then on)."""
        with self._lock:
            self._wanted = [(a - self.base, b - self.base) for a, b in spans if b > a]
            self._version += 1

    def pieces(self, k: int, size: int) -> Iterator[tuple[int, int]]:
        """Range ``k`` in pieces of ``size`` bytes (offsets from the range's start), each once,
        in the order to land them: those :meth:`prefer` asked for, then in address order."""
        lo, hi = self.ranges[k]
        n = -(-(hi - lo) // size)
        taken = bytearray(n)
        seq, version, wanted, at = 0, -1, [], 0
        for _ in range(n):
            with self._lock:
                if version != self._version:  # asked for again: from its start
                    version, at = self._version, 0
                    wanted = [i for a, b in self._wanted if max(a, lo) < min(b, hi)
                              for i in range((max(a, lo) - lo) // size,
                                             (min(b, hi) - lo - 1) // size + 1)]
            while at < len(wanted) and taken[wanted[at]]:
                at += 1
            if at < len(wanted):
                i = wanted[at]
            else:
                while taken[seq]:
                    seq += 1
                i = seq
            taken[i] = 1
            yield i * size, min((i + 1) * size, hi - lo)

    def finish(self, error: BaseException | None = None) -> None:
        """Every range has landed, or ``error`` stopped it: no gate waits any longer (a later
        call changes nothing)."""
        with self._lock:
            if self._done:
                return
            self._done, self._error = True, error
            waiters, self._waiters = self._waiters, []
        for _, _, ev in waiters:
            ev.set()

    def gate(self, addr: int, end: int, timeout: float | None = None) -> bool:
        """Block until the host bytes at addresses ``[addr, end)`` have landed (True), or for
        ``timeout`` seconds at most (False if they have not); raise if emptying the staging
        buffers failed."""
        a, b = addr - self.base, end - self.base
        ev = threading.Event()
        with self._lock:
            if self._ready(a, b):
                return True
            self._waiters.append((a, b, ev))
        woken = ev.wait(timeout)
        with self._lock:
            if not woken:  # timed out: no longer waiting (the bytes may have come just now)
                self._waiters = [w for w in self._waiters if w[2] is not ev]
            return self._ready(a, b)

    def _ready(self, a: int, b: int) -> bool:
        """Whether ``[a, b)`` has landed; raise if emptying the staging buffers failed."""
        if self._error is not None:
            raise CheckpointError(f"the snapshot did not reach host memory: "
                                  f"{type(self._error).__name__}: {self._error}")
        return self._landed(a, b)

    def _landed(self, a: int, b: int) -> bool:
        if self._done:
            return True
        return all(_covers(have, max(a, lo), min(b, hi))
                   for (lo, hi), have in zip(self.ranges, self._have, strict=True)
                   if max(a, lo) < min(b, hi))


def _merge(have: list[tuple[int, int]], a: int, b: int) -> None:
    """Add ``[a, b)`` to ``have``: sorted, disjoint intervals, none touching another."""
    if a >= b:
        return
    i = bisect_right(have, (a, a)) - 1  # the last one starting at or before a
    if i < 0 or have[i][1] < a:
        i += 1
    j = i
    while j < len(have) and have[j][0] <= b:
        j += 1
    if i < j:
        a, b = min(a, have[i][0]), max(b, have[j - 1][1])
    have[i:j] = [(a, b)]


def _covers(have: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether one interval of ``have`` holds all of ``[a, b)``."""
    i = bisect_right(have, (a, float("inf"))) - 1
    return i >= 0 and have[i][0] <= a and have[i][1] >= b


def unstage(stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor,
            ring: torch.Tensor | None = None,
            on_landed: Callable[[int, int], None] | None = None,
            order: Callable[[int], Iterator[tuple[int, int]]] | None = None) -> None:
    """Copy device ``src`` to host ``dst`` on ``stream``, at most D2H_DEPTH pieces queued:
    straight when ``dst`` is page-locked (``ring`` None), else through ``ring``;
    ``on_landed(a, b)`` once bytes ``[a, b)`` are in ``dst``; ``order(size)``: the pieces of
    ``size`` bytes in the order to copy them (:meth:`Landing.pieces`; default: in order)."""
    def pieces(size: int) -> Iterator[tuple[int, int]]:
        if order is not None:
            return order(size)
        return ((a, min(a + size, src.numel())) for a in range(0, src.numel(), size))

    if ring is not None:
        _unstage_ring(stream, src, dst, ring, on_landed, pieces)
        return
    queued: deque[tuple[torch.cuda.Event, int, int]] = deque()
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for a, b in pieces(D2H_CHUNK):
            if len(queued) >= D2H_DEPTH:
                _landed(*queued.popleft(), on_landed)
            dst[a:b].copy_(src[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            queued.append((ev, a, b))
        for ev, a, b in queued:
            _landed(ev, a, b, on_landed)


def _landed(ev: torch.cuda.Event, a: int, b: int,
            on_landed: Callable[[int, int], None] | None) -> None:
    ev.synchronize()
    if on_landed is not None:
        on_landed(a, b)


def _unstage_ring(stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor,
                  ring: torch.Tensor, on_landed: Callable[[int, int], None] | None,
                  pieces: Callable[[int], Iterator[tuple[int, int]]]) -> None:
    """Copy device ``src`` to pageable ``dst`` through the two page-locked halves of ``ring``:
    while one piece comes over from the GPU (one at a time, as D2H_DEPTH wants), the CPU
    copies the one before into place. A device-to-host copy into pageable memory would instead
    go through the driver's own staging, and cost the training loop about 0.35 s per 5.8 GB
    (``bench/probe_snapshot.py``)."""
    half = ring.numel() // 2
    slots = (ring[:half], ring[half:])
    landed: tuple[torch.cuda.Event, int, int, torch.Tensor] | None = None
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for k, (a, b) in enumerate(pieces(half)):
            slot = slots[k % 2]
            slot[: b - a].copy_(src[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            if landed is not None:
                _land(*landed, dst, on_landed)
            landed = (ev, a, b, slot)
        if landed is not None:
            _land(*landed, dst, on_landed)


def _land(ev: torch.cuda.Event, a: int, b: int, slot: torch.Tensor, dst: torch.Tensor,
          on_landed: Callable[[int, int], None] | None) -> None:
    ev.synchronize()
    host_copy(dst[a:b], slot[: b - a])
    if on_landed is not None:
        on_landed(a, b)
