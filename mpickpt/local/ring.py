"""A ring of slots through which a restore's received bytes go to the GPU.

A lost node's shard (or any bytes another rank sends a restore) bound for a state on a GPU does
not need a host buffer as large as itself, faulted in and page-locked before the first byte can
come (0.5-0.8 s for 2.8 GB on an H100 host): each group of received spans lands in one slot of a
small ring, is verified there against the manifest and copied to the GPU memory set aside for
the restore, both on the I/O threads, and the slot is used again by a later group.
:func:`mpickpt.local.remote.fetch` drives it: a group's receives are posted only once the group
that last used its slot is done with it (:meth:`Ring.wait_free`, on the transfer thread).

Copies into the GPU are fastest from page-locked memory (52-55 GB/s against 6.4-6.6 GB/s from
ordinary pages on an H200 host), but page-locking is not always quick: in a lost node's restore
on a host of two H200s the first 64 MiB slot took 0.33 s to lock, then 34 ms each, while the
transfer waited (in isolation: 8 ms). So the slots are ordinary memory to begin with, there at
once. Once each has been used, page-locked twins are made on a thread of their own, and a
group takes its slot's twin once it is there, else the ordinary slot. Page-locking a first
twin still held the copies into the GPU back for about 0.2 s (the receives waited for their
slots meanwhile), so it is left until the first bytes are in, and a transfer of fewer groups
than slots locks nothing. An XOR rebuild keeps the buffers it first took, each swapped for its
twin once made (:meth:`Ring.make_twins`, at its start): copied into the GPU from ordinary
pages, a lost member's blocks were used more slowly than the ring brought them
(``docs/performance.md``).
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
    """A ring for checksum blocks of ``block`` bytes in memory of its own (not a slot of the
    Checkpointer's pool, which the restore's buffer takes), and what lets it go. Its slots are
    there at once, in ordinary pages (faulted in as the first bytes land); where ``pin``, once
    every slot has been used (:attr:`Ring.warm`), a page-locked twin of each is made on a
    thread of its own and used from then on (:meth:`Ring.slot`). A twin that cannot be made
    leaves its slot as it is."""
    size = slot_bytes(block)
    plain = HostPool(SLOTS * size, slots=SLOTS, pin=False)
    slots = [plain.acquire(size) for _ in range(SLOTS)]

    def let_go_plain() -> None:
        for slot in slots:
            plain.release(slot)
        plain.close()

    if not pin:
        return Ring(slots, size), let_go_plain
    locked = HostPool(SLOTS * size, slots=SLOTS, pin=True)
    twins: list[Future[torch.Tensor]] = [Future() for _ in range(SLOTS)]
    ring = Ring(slots, size, twins)
    closing = threading.Event()

    def make() -> None:  # on a thread of its own: not in the way
        ring.warm.wait()
        for twin in twins:
            if closing.is_set():  # (the transfer ended first: no twin is needed)
                twin.set_exception(RingAbandoned("the ring was let go"))
                continue
            try:
                buf = locked.acquire(size)
            except BaseException as e:  # (no memory: the ordinary slots serve)
                log.warning("restore: the ring's slots stay pageable: %s", e)
                for rest in twins:
                    if not rest.done():
                        rest.set_exception(e)
                return
            try:
                locked.lock(buf)
            except Exception as e:
                log.warning("restore: a ring slot stays pageable: %s", e)
                locked.release(buf)
                twin.set_exception(e)
                continue
            twin.set_result(buf)

    threading.Thread(target=make, daemon=True, name="mpickpt-ring").start()

    def close() -> None:
        closing.set()
        ring.warm.set()
        try:
            for twin in twins:
                if twin.exception() is None:  # (waits for it)
                    locked.release(twin.result())
        finally:
            locked.close()
            let_go_plain()

    return ring, close


class RingAbandoned(RuntimeError):
    """The restore's transfer stopped: no slot will be freed."""


class Ring:
    """:data:`SLOTS` slots of ``size`` bytes in ``buf`` (a uint8 CPU tensor of at least
    ``SLOTS * size`` bytes, or the slots themselves), each with a page-locked twin where
    ``twins`` (futures: used once there). Ring group ``r`` uses slot ``r % SLOTS``, once ring
    group ``r - SLOTS`` has released it."""

    def __init__(self, buf: torch.Tensor | list[torch.Tensor], size: int,
                 twins: list[Future[torch.Tensor]] | None = None) -> None:
        self.size = size
        self._slots = buf if isinstance(buf, list) else self._cut(buf)
        self.twins = twins or []  # the page-locked twins, as they are made
        self.warm = threading.Event()  # set once every slot was used and released
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
        """The slots themselves (not their twins)."""
        return list(self._slots)

    def slot(self, r: int) -> torch.Tensor:
        """Ring group ``r``'s slot: its page-locked twin where that is made, else the slot
        itself (the caller lands and reads the group in what this returns, so that a twin
        made meanwhile changes nothing for it)."""
        i = r % SLOTS
        if self.twins:
            twin = self.twins[i]
            if twin.done() and twin.exception() is None:
                return twin.result()
        return self._slots[i]

    def make_twins(self) -> None:
        """Have the page-locked twins made from now on, without waiting for every slot to be
        used (:attr:`warm`): for a user that keeps the slots it first took."""
        self.warm.set()

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
            if len(self._done) >= SLOTS:
                self.warm.set()
            self._cond.notify_all()

    def abandon(self) -> None:
        """Wake every :meth:`wait_free` with :class:`RingAbandoned` (the transfer failed)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
