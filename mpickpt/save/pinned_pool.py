"""Host buffers for snapshots, allocated once and reused; page-locked only when asked.

The pool holds at most ``slots`` buffers (``max_in_flight``). A snapshot takes a free buffer that
is large enough, or allocates one while the budget allows; otherwise it waits until a save in
flight releases one. A snapshot larger than the budget is refused with :class:`PinnedBudgetError`
before anything is allocated, and so is one that would not fit in the memory the machine has
available: a clear error, never an OOM kill.

Buffers are allocated pageable. Page-locking (``cudaHostRegister``, with CUDA) holds the CUDA
driver for about 0.6 s per GB, and the training loop waits behind it from whichever thread it
runs (measured on an H200: 5.84 GB, 3.4 s lost by the loop, or 0.34 s when done in small pieces
with pauses: ``bench/probe_snapshot.py``). So a buffer is page-locked only by :meth:`HostPool.lock`:
``Checkpointer.prepare()`` and a restore (both before the loop), and a snapshot that must copy
from the GPU straight into it (no room on the GPU for staging). Otherwise the snapshot's GPU
staging buffer is emptied into the pageable buffer through a small page-locked ring
(:mod:`mpickpt.save.snapshot`).
"""

from __future__ import annotations

import functools
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..format import pages
from ..format.blocks import ALIGN, align


class PinnedBudgetError(CheckpointError):
    """A snapshot does not fit the host memory budget."""


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


HUGE = 2 << 20  # buffers from this size on are asked to be backed by huge pages
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_on_request() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks for them
    (``always`` or ``madvise`` selected in :data:`THP`)."""
    try:
        with open(THP) as f:
            mode = f.read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def host_buffer(nbytes: int, huge: bool = False) -> torch.Tensor:
    """``nbytes`` of page-aligned host memory (so that whole pages can bypass the page cache).

    With ``huge`` (a pool that page-locks: CUDA), from :data:`HUGE` bytes on and where the
    kernel offers transparent huge pages on request (``madvise``), the buffer is an anonymous
    mapping advised to use them: one page fault per 2 MiB instead of 512, and 512 times fewer
    pages to page-lock. Measured in fresh processes on an H100 host, 3 GB: touched in
    0.075-0.096 s against 0.16-0.23 s, page-locked untouched in 0.62-0.68 s against 0.98-1.18 s
    (docs/performance.md). On the 2-core CPU VM a fresh process's huge pages
    were slower to touch (2 GB: 1.6 s against 0.8 s), so CPU-only pools keep ordinary pages.
    The mapping is unmapped when the tensor is freed."""
    if huge and nbytes >= HUGE and huge_pages_on_request():
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(region, dtype=torch.uint8)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + nbytes]


def _remove(buffers: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Take ``buf`` itself out of ``buffers`` (``list.remove`` would compare tensors by value,
    element by element, past the first one that is not ``buf``)."""
    del buffers[next(i for i, b in enumerate(buffers) if b is buf)]


@dataclass(eq=False)
class Lease:
    """A slot of the pool taken for one snapshot: its buffer, or None until :meth:`HostPool.fill`
    allocates it (off the training thread: page-locking gigabytes takes seconds)."""

    nbytes: int
    buffer: torch.Tensor | None = None
    new: bool = False  # its buffer allocated for it: none of its pages touched yet


class HostPool:
    """At most ``slots`` reusable host buffers within ``budget`` bytes for this rank."""

    def __init__(self, budget: int, slots: int = 1, pin: bool | None = None) -> None:
        if slots < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.budget = budget
        self.slots = slots
        self.pin = torch.cuda.is_available() if pin is None else pin  # lock() page-locks
        self._free: list[torch.Tensor] = []
        self._allocated: list[torch.Tensor] = []
        # called with each buffer the pool lets go (what keeps views of it forgets them)
        self.dropped: list[Callable[[torch.Tensor], None]] = []
        self._locked: dict[int, int] = {}  # data pointer -> bytes of each page-locked buffer
        self._reserved: list[Lease] = []  # slots taken whose buffer is not allocated yet
        self._cond = threading.Condition()
        self.waited_s = 0.0  # time the last acquire() spent waiting for a buffer

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._allocated)

    def _check(self, nbytes: int) -> None:
        if nbytes > self.budget:
            raise PinnedBudgetError(
                f"a snapshot of {nbytes / 1e9:.3f} GB does not fit this rank's host buffer budget "
                f"of {self.budget / 1e9:.3f} GB; raise Checkpointer(pinned_budget=...) (bytes per "
                "node, shared by its ranks) or checkpoint less state per rank")
        avail = available_memory()
        if avail is not None and nbytes > avail * 0.9:
            raise PinnedBudgetError(
                f"a snapshot of {nbytes / 1e9:.3f} GB would not fit in the "
                f"{avail / 1e9:.3f} GB of memory this machine has available; refusing rather "
                "than being killed for lack of memory")

    @property
    def locked_bytes(self) -> int:
        """The bytes of the pool's buffers that are page-locked."""
        return sum(self._locked.values())

    def _new(self, nbytes: int) -> torch.Tensor:
        self._check(nbytes)
        return host_buffer(nbytes, huge=self.pin)

    def is_locked(self, buf: torch.Tensor) -> bool:
        return buf.data_ptr() in self._locked

    def lock(self, buf: torch.Tensor) -> bool:
        """Page-lock ``buf`` (one of the pool's) for fast asynchronous copies from and to the
        GPU, unless it is already or the pool does not pin; whether it is locked now. Holds
        the CUDA driver for about 0.6 s per GB: before the training loop, or where the loop
        would wait anyway."""
        if not self.pin:
            return False
        ptr, nbytes = buf.data_ptr(), buf.numel()
        if ptr not in self._locked:
            # its pages faulted in first, by torch's threads: cudaHostRegister faults them in
            # one at a time (a fresh 3 GB buffer of huge pages on an H100 host: touched in
            # 0.08-0.10 s, then page-locked in about 0.09 s, against 0.62-0.68 s untouched).
            # Every caller locks a buffer before writing into it, so its contents can go.
            buf.zero_()
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                raise CheckpointError(f"page-locking a host buffer of {nbytes / 1e9:.3f} GB "
                                      f"failed (cudaHostRegister error {int(err)}); lower "
                                      "Checkpointer(pinned_budget=...) or the memlock limit")
            self._locked[ptr] = nbytes
        return True

    def _unlock(self, buf: torch.Tensor) -> None:
        if self._locked.pop(buf.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def __del__(self) -> None:
        """A pool dropped without close() (its Checkpointer never closed): its buffers are
        about to be freed, so unlock them first (freed memory must not stay registered)."""
        for ptr in list(getattr(self, "_locked", {})):
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def close(self) -> None:
        """Unlock the free buffers and let them go (every save and restore is over)."""
        with self._cond:
            for buf in self._free:
                self._drop(buf)
            self._free.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        """Let ``buf`` go (out of the free list already): nothing may keep views of it."""
        for forget in self.dropped:
            forget(buf)
        _remove(self._allocated, buf)
        self._unlock(buf)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; waits for a release when all slots are in flight."""
        return self.acquire_new(nbytes)[0]

    def acquire_new(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """:meth:`acquire`, and whether the buffer is a new one (none of its pages touched)."""
        lease = self.reserve(nbytes, defer=False)
        assert lease.buffer is not None
        return lease.buffer, lease.new

    def reserve(self, nbytes: int, defer: bool) -> Lease:
        """A slot for ``nbytes``: a free buffer that fits, else a new one (with ``defer``: one
        that :meth:`fill` allocates later); waits for a release when all slots are in flight."""
        nbytes = align(max(nbytes, 1))
        if not any(b.numel() >= nbytes for b in self._free):  # (a reused buffer needs no memory:
            self._check(nbytes)  # no reading of /proc/meminfo on every save; _new() checks too)
        t0 = time.perf_counter()
        with self._cond:
            while True:
                fits = [b for b in self._free if b.numel() >= nbytes]
                if fits:
                    lease = Lease(nbytes, min(fits, key=lambda b: b.numel()))
                    _remove(self._free, lease.buffer)
                    break
                in_use = (self.allocated_bytes - sum(b.numel() for b in self._free)
                          + sum(r.nbytes for r in self._reserved))
                if (len(self._allocated) + len(self._reserved) < self.slots
                        and in_use + nbytes <= self.budget):
                    lease = Lease(nbytes)
                    if defer:
                        self._reserved.append(lease)
                    else:
                        lease.buffer, lease.new = self._new(nbytes), True
                        self._allocated.append(lease.buffer)
                    break
                if self._free:  # a free buffer too small: replace it (the state grew)
                    self._drop(self._free.pop())
                    continue
                self._cond.wait()
        self.waited_s = time.perf_counter() - t0
        return lease

    def fill(self, lease: Lease) -> torch.Tensor:
        """Allocate a deferred lease's buffer (outside the lock: it may take seconds)."""
        if lease.buffer is None:
            buf = self._new(lease.nbytes)
            with self._cond:
                self._reserved.remove(lease)
                self._allocated.append(buf)
                lease.buffer = buf
        return lease.buffer

    def release(self, item: torch.Tensor | Lease) -> None:
        """Give a buffer (or a lease, allocated or not) back."""
        with self._cond:
            if isinstance(item, Lease):
                if item.buffer is None:
                    self._reserved.remove(item)
                else:
                    self._free.append(item.buffer)
            else:
                self._free.append(item)
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._allocated) + len(self._reserved) - len(self._free)


class Taken:
    """The buffers one restore takes from ``pool`` on its own thread, each page-locked where
    asked, all given back at once by :meth:`release`."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.buffers: list[torch.Tensor] = []
        self._stops: list[threading.Event] = []  # the faulting-in threads', set at release

    def take(self, nbytes: int, lock: bool) -> torch.Tensor:
        """A buffer of at least ``nbytes``; page-locked if ``lock`` (and the pool pins). A new
        one that is not page-locked (which faults it in) is faulted in behind the reads
        (:func:`fault_in_behind`)."""
        buf, new = self.pool.acquire_new(nbytes)
        self.buffers.append(buf)  # (given back even if locking fails)
        if lock and self.pool.lock(buf):
            return buf
        if new and nbytes >= BEHIND_FROM:
            self._stops.append(threading.Event())
            fault_in_behind(buf, self._stops[-1])
        return buf

    def release(self) -> None:
        for stop in self._stops:
            stop.set()
        self._stops.clear()
        for buf in self.buffers:
            self.pool.release(buf)
        self.buffers.clear()


BEHIND_FROM = 64 << 20  # a restore's new buffers from this size on are faulted in behind
BEHIND_PIECE = 8 << 20


def fault_in_behind(buf: torch.Tensor, stop: threading.Event | None = None
                    ) -> threading.Thread:
    """Fault the pages of ``buf`` (new host memory) in for writing on a thread of its own, in
    pieces from its end back to its start, while the caller fills it from the start, until
    ``stop`` is set: a restore's reads and receives then find most of their pages there,
    instead of taking a page fault every 4 KiB themselves (a new 252 MB buffer on the 2-core
    VM: 0.07 s to touch against 0.01 s for the same memory again; a lost node's restore there
    0.19-0.26 s against 0.25-0.30 s without, docs/performance.md). Changes no byte; the thread
    keeps ``buf`` alive until it is done."""
    page = mmap.PAGESIZE
    base = buf.data_ptr()
    first = -base % page
    last = (buf.numel() - first) // page * page + first  # whole pages only

    def run() -> None:
        for a in range(last - BEHIND_PIECE, first - BEHIND_PIECE, -BEHIND_PIECE):
            lo = max(a, first)
            if (stop is not None and stop.is_set()) or \
                    not pages.populate(base, lo, a + BEHIND_PIECE - lo, write=True):
                break  # (a kernel without it: the pages come in at their first touch)
        del keep[:]

    keep = [buf]
    t = threading.Thread(target=run, daemon=True, name="mpickpt-fault-in")
    t.start()
    return t
