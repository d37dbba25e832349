"""A ring of page-locked slots through which a restore's received bytes go to the GPU.

A lost node's shard (or any bytes another rank sends a restore) bound for a state on a GPU does
not need a host buffer as large as itself, faulted in and page-locked before the first byte can
come (0.5-0.8 s for 2.8 GB on an H100 host): each group of received spans lands in one slot of a
small page-locked ring, is verified there against the manifest and copied to the GPU memory set
aside for the restore, both on the I/O threads, and the slot is used again by a later group.
:func:`mpickpt.local.remote.fetch` drives it: a group's receives are posted only once the group
that last used its slot is done with it (:meth:`Ring.wait_free`, on the transfer thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..save.pinned_pool import HostPool

log = logging.getLogger("mpickpt")

SLOT = 64 << 20  # bytes per slot, at least (a whole number of checksum blocks)
SLOTS = 6  # the groups posted ahead (remote's transfer posts 4) and two being used


def slot_bytes(block: int) -> int:
    """The size of a slot for checksum blocks of ``block`` bytes: whole blocks, at least
    :data:`SLOT`."""
    return max(1, -(-SLOT // block)) * block


def pinned_ring(block: int, pin: bool) -> tuple[Ring, Callable[[], None]]:
    """A ring for checksum blocks of ``block`` bytes in memory of its own, page-locked where
    ``pin`` (not a slot of the Checkpointer's pool, which the restore's buffer takes), and
    what lets it go. Each slot is there as soon as it is locked, the first after about a
    sixth of the whole ring's time (page-locking 384 MiB took 0.11-0.12 s on an H200 host):
    the first receives are posted before the last slots are locked."""
    size = slot_bytes(block)
    pool = HostPool(SLOTS * size, slots=SLOTS, pin=pin)
    made: list[Future[torch.Tensor]] = [Future() for _ in range(SLOTS)]

    def make() -> None:  # on a thread of its own: not in the way
        for i, slot in enumerate(made):
            try:
                buf = pool.acquire(size)
            except BaseException as e:  # (no memory: the transfer fails)
                for rest in made[i:]:
                    rest.set_exception(e)
                return
            try:  # a slot that cannot be page-locked is used as it is: slower copies, and
                pool.lock(buf)  # the receives already posted into the others still land
            except Exception as e:
                log.warning("restore: a ring slot stays pageable: %s", e)
            slot.set_result(buf)

    threading.Thread(target=make, daemon=True, name="mpickpt-ring").start()

    def close() -> None:
        try:
            for slot in made:
                if slot.exception() is None:  # (waits for it)
                    pool.release(slot.result())
        finally:
            pool.close()

    return Ring(made, size), close


def _done(t: torch.Tensor) -> Future[torch.Tensor]:
    f: Future[torch.Tensor] = Future()
    f.set_result(t)
    return f


class RingAbandoned(RuntimeError):
    """The restore's transfer stopped: no slot will be freed."""


class Ring:
    """:data:`SLOTS` slots of ``size`` bytes in ``buf`` (a page-locked uint8 CPU tensor of at
    least ``SLOTS * size`` bytes, or a future of each slot: a slot is there once it is). Ring
    group ``r`` uses slot ``r % SLOTS``, once ring group ``r - SLOTS`` has released it."""

    def __init__(self, buf: torch.Tensor | list[Future[torch.Tensor]], size: int) -> None:
        self.size = size
        self._made = buf if isinstance(buf, list) else [_done(b) for b in self._cut(buf)]
        self._done: set[int] = set()
        self._cond = threading.Condition()
        self._abandoned = False

    def _cut(self, buf: torch.Tensor) -> list[torch.Tensor]:
        if buf.numel() < SLOTS * self.size:
            raise ValueError(f"a ring of {SLOTS} slots of {self.size} bytes needs "
                             f"{SLOTS * self.size} bytes, not {buf.numel()}")
        return [buf[i * self.size:(i + 1) * self.size] for i in range(SLOTS)]

    @property
    def slots(self) -> list[torch.Tensor]:
        """The slots, once their memory is there (they may still be being page-locked)."""
        return [f.result() for f in self._made]

    def slot(self, r: int) -> torch.Tensor:
        """Ring group ``r``'s slot, once its memory is there."""
        return self._made[r % SLOTS].result()

    def wait_free(self, r: int) -> None:
        """Until ring group ``r``'s slot may be written; :class:`RingAbandoned` once
        :meth:`abandon` was called."""
        with self._cond:
            while r >= SLOTS and r - SLOTS not in self._done and not self._abandoned:
                self._cond.wait()
            if self._abandoned:
                raise RingAbandoned("the transfer into the restore's ring was abandoned")

    def release_after(self, r: int, futures: list[Future[None]]) -> None:
        """Release ring group ``r``'s slot once ``futures`` (what reads it) are done, whatever
        their outcome (their errors are the caller's to gather)."""
        if not futures:
            self._release(r)
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: object) -> None:
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                self._release(r)

        for f in futures:
            f.add_done_callback(one_done)

    def _release(self, r: int) -> None:
        with self._cond:
            self._done.add(r)
            self._cond.notify_all()

    def abandon(self) -> None:
        """Wake every :meth:`wait_free` with :class:`RingAbandoned` (the transfer failed)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
