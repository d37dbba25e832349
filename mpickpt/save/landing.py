"""Landing: a snapshot's device staging buffers emptied into its host buffer, and how far that has
got, so that the shard's writer can write each block as soon as its bytes are in host memory.

The persist thread empties the staging buffers (:func:`unstage`) piece by piece and says after
each piece how far it has landed (:meth:`Landing.landed`); the I/O threads, writing the shard's
blocks in the host buffer's order, wait in :meth:`Landing.gate` until the block they are about to
hash and write has landed. While the job trains, emptying 5.84 GB took 0.4-2.8 s on an H100
(0.14-0.26 s with the loop stopped), and the write after it as long again: one after the other,
they made a save's persist twice the disk's bound.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from ..errors import CheckpointError
from ..format.hostcopy import host_copy

# The staging->host copy goes in pieces of this size, at most D2H_DEPTH queued at a time.
D2H_CHUNK = 4 << 20
D2H_DEPTH = 1


class Landing:
    """How far each range ``[lo, hi)`` of a host buffer at address ``base``, filled from a
    staging buffer, has landed; bytes outside those ranges are there already."""

    def __init__(self, base: int, ranges: list[tuple[int, int]]) -> None:
        self.base, self.ranges = base, ranges
        self._upto = [lo for lo, _ in ranges]
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._done = False

    def landed(self, k: int, upto: int) -> None:
        """Range ``k`` has landed up to offset ``upto`` of the host buffer."""
        with self._cv:
            self._upto[k] = upto
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """Every range has landed, or ``error`` stopped it: no gate waits any longer (a later
        call changes nothing)."""
        with self._cv:
            if self._done:
                return
            self._done, self._error = True, error
            self._cv.notify_all()

    def gate(self, addr: int, end: int, timeout: float | None = None) -> bool:
        """Block until the host bytes at addresses ``[addr, end)`` have landed (True), or for
        ``timeout`` seconds at most (False if they have not); raise if emptying the staging
        buffers failed."""
        a, b = addr - self.base, end - self.base
        with self._cv:
            return self._cv.wait_for(lambda: self._ready(a, b), timeout)

    def _ready(self, a: int, b: int) -> bool:
        if self._error is not None:
            raise CheckpointError(f"the snapshot did not reach host memory: "
                                  f"{type(self._error).__name__}: {self._error}")
        if self._done:
            return True
        return all(upto >= min(b, hi) for (lo, hi), upto in zip(self.ranges, self._upto,
                                                                strict=True)
                   if max(a, lo) < min(b, hi))


def unstage(stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor,
            ring: torch.Tensor | None = None,
            on_landed: Callable[[int], None] | None = None) -> None:
    """Copy device ``src`` to host ``dst`` on ``stream``, at most D2H_DEPTH pieces queued:
    straight when ``dst`` is page-locked (``ring`` None), else through ``ring``;
    ``on_landed(n)`` once the first ``n`` bytes are in ``dst``."""
    if ring is not None:
        _unstage_ring(stream, src, dst, ring, on_landed)
        return
    queued: deque[tuple[torch.cuda.Event, int]] = deque()
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for a in range(0, src.numel(), D2H_CHUNK):
            if len(queued) >= D2H_DEPTH:
                _landed(*queued.popleft(), on_landed)
            b = min(a + D2H_CHUNK, src.numel())
            dst[a:b].copy_(src[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            queued.append((ev, b))
        for ev, b in queued:
            _landed(ev, b, on_landed)


def _landed(ev: torch.cuda.Event, b: int, on_landed: Callable[[int], None] | None) -> None:
    ev.synchronize()
    if on_landed is not None:
        on_landed(b)


def _unstage_ring(stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor,
                  ring: torch.Tensor, on_landed: Callable[[int], None] | None) -> None:
    """Copy device ``src`` to pageable ``dst`` through the two page-locked halves of ``ring``:
    while one piece comes over from the GPU (one at a time, as D2H_DEPTH wants), the CPU
    copies the one before into place. A device-to-host copy into pageable memory would instead
    go through the driver's own staging, and cost the training loop about 0.35 s per 5.8 GB
    (``bench/probe_snapshot.py``)."""
    half = ring.numel() // 2
    slots = (ring[:half], ring[half:])
    landed: tuple[torch.cuda.Event, int, int, torch.Tensor] | None = None
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for k, a in enumerate(range(0, src.numel(), half)):
            b = min(a + half, src.numel())
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
          on_landed: Callable[[int], None] | None) -> None:
    ev.synchronize()
    host_copy(dst[a:b], slot[: b - a])
    if on_landed is not None:
        on_landed(b)
