"""Snapshot: copy every tensor of a flattened state into a reusable host buffer, asynchronously.

CUDA tensors: an event recorded on the current stream orders a dedicated copy stream after the
work already queued; on that stream the tensors are copied into a device staging buffer (when GPU
memory allows: a device-to-device copy at HBM speed), or straight to the host buffer otherwise.
``take`` returns once the copies are queued. The persist thread then empties the staging buffer
into the host buffer in :meth:`Snapshot.wait` (4 MiB pieces straight into a page-locked buffer;
else through the ring below, whose CPU copy is :func:`mpickpt.format.hostcopy.host_copy`), while the
I/O threads write the shard's blocks that have landed (:mod:`mpickpt.save.landing`). Measured on an
H200: while the copy engine always has a device-to-host transfer queued (the whole state, or even
two 32 MiB pieces kept in flight), a device-to-host copy of the training loop (``loss.item()``)
from another stream starves until the engine is idle (95 ms for 5.8 GB); with one piece in flight
it gets in within 3 ms, and the emptying takes 122 ms instead of 106.

The next mutation must not race the copies: :meth:`Snapshotter.fence` (called by an optimizer
pre-step hook and a module forward pre-hook) makes the current stream wait for the copy out of the
user's tensors to finish, a GPU-side wait that costs the Python thread nothing. The user's tensors
are kept alive until then. A state that holds CUDA tensors no such hook guards (``state_dict()``s,
as the Lightning and Hugging Face integrations save: the next optimizer step changes them, and
no hook of ours runs first) is fenced by ``take`` itself, at once.

CPU tensors that only an optimizer in the state changes (its parameters and its state) are copied
lazily, on the snapshot thread, while forward and backward run: the optimizer's step pre-hook
waits for that copy (DataStates' lazy snapshot). Other CPU tensors (buffers, which a forward
pass may change, and anything else) are copied on the spot, so mutating them after ``take``
returns is safe.

The pool's buffer is allocated on the snapshot thread too, when nothing has to go into it on the
spot: the first checkpoint does not stall the loop for the allocation. It is page-locked only
when something page-locked it (``prepare()``, a restore, or a snapshot with no room for GPU
staging, which copies straight into it): page-locking holds the CUDA driver, and the loop with
it, for about 0.6 s per GB (:mod:`mpickpt.save.pinned_pool`). A staging buffer is emptied into a
buffer that is not page-locked through a ring of two page-locked pieces of 16 MiB (page-locked
when the Checkpointer is made if the process uses CUDA already): one piece
comes over from the GPU while the other is copied into place by the CPU.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.hostcopy import copy_all
from . import layout, owners
from .landing import Landing, unstage
from .pinned_pool import HostPool, Lease

# Through the ring (into a pageable buffer), in pieces of this size: each piece takes the
# Python interpreter's lock three times, which a training thread holds most of the time (on an
# H200 with 4 MiB pieces, emptying 5.84 GB took seconds longer while the job trained)
RING_PIECE = 16 << 20
# CPU tensors copied on the spot go through a temporary copy when the pool's buffer is still to
# be allocated, up to this many bytes; beyond it the buffer is allocated on the spot instead
CLONE_MAX = 16 << 20
# below this many bytes (lazy copies and a buffer to allocate together) the snapshot thread is
# not worth waking: everything is done on the spot
LAZY_MIN = 8 << 20
# nor below this many CPU tensors: many small ones cost their copy 0.5-1 µs each, whatever
# their bytes (8,000: about 6 ms on this project's VM)
LAZY_COUNT = 2048

# what guard() knows of the optimizers and modules in a state, worked out when first asked for:
# (CPU data pointer -> bytes only an optimizer changes, the data pointers the hooks guard)
Maps = Callable[[], tuple[dict[int, int], set[int]]]


def _no_maps() -> tuple[dict[int, int], set[int]]:
    return {}, set()


@dataclass
class Snapshot:
    """One checkpoint's host copy; :attr:`tensors` (views of the pool's buffer) are filled and
    valid after :meth:`wait`."""

    nbytes: int
    count: int  # how many tensors
    lease: Lease
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stall_s: float = 0.0  # time take() spent on the training thread
    ready: Future[None] | None = None  # the snapshot thread's part: allocation, lazy copies
    done_events: list[torch.cuda.Event] = field(default_factory=list)
    start_events: list[torch.cuda.Event] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    # (stream, staging range, start and end in the host buffer)
    unstage: list[tuple[torch.cuda.Stream, torch.Tensor, int, int]] = field(default_factory=list)
    staging_free: threading.Event = field(default_factory=threading.Event)
    copy_s: float = 0.0
    # where copy_s went: the wait for the snapshot thread, the device copies (from the event
    # on the training stream to their end), emptying the staging buffers (wall clock)
    parts: dict[str, float] = field(default_factory=dict)
    lazy_s: float = 0.0  # the snapshot thread's part, when there was one
    # the page-locked pieces the staging buffer goes through into the host buffer (None when
    # that is page-locked), asked for when it is emptied
    ring: Callable[[], torch.Tensor | None] | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        return self.lease.buffer

    def landing(self) -> Landing | None:
        """For a writer that starts before the staging buffers are emptied: how far they have
        landed, once everything else has (None when there is nothing to empty: :meth:`wait`
        then). :meth:`wait` with it empties them."""
        if not self.unstage:
            return None
        if self.ready is not None:
            self.ready.result()
        for ev in self.done_events:  # copies straight into the host buffer, and the staging
            ev.synchronize()
        assert self.lease.buffer is not None
        return Landing(self.lease.buffer.data_ptr(), [(lo, hi) for *_, lo, hi in self.unstage])

    def wait(self, landing: Landing | None = None) -> None:
        """Block until every copy has landed in host memory; release the user's tensors.
        Called by the persist thread; empties the staging buffers, telling ``landing`` how far
        as it goes."""
        t0, error = time.perf_counter(), None
        try:
            if self.ready is not None:
                self.ready.result()
            self.parts["ready_s"] = time.perf_counter() - t0
            assert self.lease.buffer is not None
            ring = self.ring() if self.ring is not None and self.unstage else None
            for k, (stream, src, lo, hi) in enumerate(self.unstage):
                unstage(stream, src, self.lease.buffer[lo:hi], ring,
                        None if landing is None else functools.partial(_at, landing, k, lo),
                        None if landing is None else functools.partial(landing.pieces, k))
        except BaseException as e:
            error = e
            raise
        finally:
            self.staging_free.set()
            if landing is not None:
                landing.finish(error)
        for ev in self.done_events:
            ev.synchronize()
        if self.done_events:
            self.copy_s = max(s.elapsed_time(d) for s, d in zip(self.start_events, self.done_events,
                                                                strict=True)) / 1e3
            self.parts["device_s"] = self.copy_s
        if self.unstage:
            waited = time.perf_counter() - t0
            self.parts["unstage_s"] = waited - self.parts["ready_s"]
            self.copy_s += waited
        self.copy_s = max(self.copy_s, self.lazy_s)
        self.sources.clear()


def _at(landing: Landing, k: int, lo: int, a: int, b: int) -> None:
    landing.mark(k, lo + a, lo + b)


class Snapshotter:
    """Takes snapshots into ``pool``; ``device_staging`` allows a GPU-side staging copy."""

    def __init__(self, pool: HostPool, device_staging: bool = True) -> None:
        self.pool = pool
        self.device_staging = device_staging
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: dict[torch.device, torch.Tensor] = {}
        self._ring: torch.Tensor | None = None  # page-locked, 2 x RING_PIECE (landing.unstage)
        self._safe: dict[torch.device, torch.cuda.Event] = {}
        self._reading: Future[None] | None = None  # the lazy copy out of the user's tensors
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-snapshot")
        self._last: Snapshot | None = None
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._hook_lock = threading.Lock()
        self._views = layout.Views()  # of the pool's buffers and the staging buffers
        pool.dropped.append(self._views.forget)

    def take(self, tensors: Mapping[str, torch.Tensor], maps: Maps | None = None) -> Snapshot:
        """Snapshot ``tensors``; from 8 MB or 2,048 CPU tensors on, those of CPU whose data
        pointer the first of ``maps()`` maps to at least their size (an optimizer's, see
        :meth:`guard`) are copied on the snapshot thread. Unless every CUDA tensor's data
        pointer is in the second, the current streams wait for the copies from now on
        (:meth:`fence`)."""
        t0 = time.perf_counter()
        maps = maps or _no_maps
        by_device, order, offsets, ranges, pos, key = layout.place(tensors)
        cpu = by_device.get(torch.device("cpu"), [])
        later: list[str] = []
        lazy = maps()[0] if (pos >= LAZY_MIN or len(cpu) >= LAZY_COUNT) and cpu else None
        if lazy:
            later = [n for n in cpu if lazy.get(tensors[n].data_ptr(), -1) >= tensors[n].nbytes]
            later_set = set(later)
            now = [n for n in cpu if n not in later_set]
        else:
            now = cpu
        if self._last is not None:  # its staging buffers must be emptied before reuse
            self._last.staging_free.wait()
        staging = {dev: self._staging_buffer(dev, hi - lo) for dev, (lo, hi) in ranges.items()
                   if dev.type == "cuda"}
        defer = (pos >= LAZY_MIN and all(b is not None for b in staging.values())
                 and sum(layout.nbytes(tensors[n]) for n in now) <= CLONE_MAX)
        lease = self.pool.reserve(pos, defer=defer)
        snap = Snapshot(pos, len(tensors), lease)
        try:
            if lease.buffer is not None:
                snap.tensors = self._host_views(lease.buffer, key, offsets, tensors)
                if any(b is None for b in staging.values()):
                    self.pool.lock(lease.buffer)  # copied straight from the GPU: page-locked
            if staging:
                snap.ring = self._ring_for(lease)
            for dev in order:
                if dev.type == "cuda":
                    names = by_device[dev]
                    self._copy_cuda(dev, [tensors[n] for n in names], names, offsets, snap,
                                    ranges[dev], staging[dev], key)
            cuda = [n for dev in order if dev.type == "cuda" for n in by_device[dev]]
            if cuda and any(tensors[n].data_ptr() not in maps()[1] for n in cuda):
                self.fence()  # on the GPU: into staging, a few milliseconds for GBs
            held: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                if lease.buffer is not None:
                    copy_all((snap.tensors[n], tensors[n]) for n in now)
                else:
                    held.update((n, tensors[n].detach().clone()) for n in now)
            held.update((n, tensors[n]) for n in later)
            if held or lease.buffer is None:
                snap.ready = self._thread.submit(self._fill, snap, key, offsets, tensors, held)
                if later:
                    self._reading = snap.ready
        except BaseException:  # (a GPU out of memory for staging, say): the buffer goes back
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no copy queued into it may land after its next use
            self.pool.release(lease)
            raise
        if not snap.unstage:
            snap.staging_free.set()
        self._last = snap
        snap.stall_s = time.perf_counter() - t0
        return snap

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocate and page-lock now what a snapshot of ``tensors`` needs: the pool's buffer
        and the device staging buffers. Page-locking gigabytes holds the CUDA driver for
        seconds (the training thread would wait behind it from whichever thread it ran); a
        page-locked buffer takes the staging buffer's bytes straight, without the ring."""
        _, _, _, ranges, pos, _ = layout.place(tensors)
        if self._last is not None:
            self._last.staging_free.wait()
        for dev, (lo, hi) in ranges.items():
            if dev.type == "cuda":
                self._warm_device(dev)
                self._staging_buffer(dev, hi - lo)
        lease = self.pool.reserve(pos, defer=False)
        try:
            assert lease.buffer is not None
            if any(dev.type == "cuda" for dev in ranges):
                self.pool.lock(lease.buffer)
        finally:
            self.pool.release(lease)

    def warm(self) -> None:
        """If this process uses CUDA already (a Checkpointer made after the model went to the
        GPU), make now the current device's copy stream, load the copy's kernel and page-lock
        the ring: the first save's window would pay them otherwise (the first stream taken
        from PyTorch's pool creates the device's whole pool: 0.05-0.12 s on an H200; the first
        ``_foreach_copy_`` loads its kernels' module, of every dtype: 0.013-0.026 s)."""
        if not torch.cuda.is_initialized():
            return
        self._warm_device(torch.device("cuda", torch.cuda.current_device()))
        if self.device_staging and self.pool.pin:
            self._page_locked_ring()

    def _warm_device(self, dev: torch.device) -> None:
        """``dev``'s copy stream made, and with device staging a copy of one element run on it
        (the kernel loaded; waited for, so that no memory of its is reused while the copy could
        still run)."""
        if dev in self._streams:
            return
        stream = self._stream(dev)
        if not self.device_staging:  # its copies are copy_'s, not a kernel of _foreach_copy_
            return
        one = torch.zeros(1, device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_([torch.empty_like(one)], [one], non_blocking=True)
        stream.synchronize()

    def _stream(self, dev: torch.device) -> torch.cuda.Stream:
        """The side stream the snapshots of ``dev``'s tensors are copied on."""
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        return stream

    def _page_locked_ring(self) -> torch.Tensor:
        """The ring, page-locked when first asked for (32 MiB: about 20 ms of the driver)."""
        if self._ring is None:
            self._ring = torch.empty(2 * RING_PIECE, dtype=torch.uint8, pin_memory=True)
        return self._ring

    def _ring_for(self, lease: Lease) -> Callable[[], torch.Tensor | None]:
        """What empties the staging buffer into ``lease``'s buffer once it is allocated: the
        ring, unless that buffer is page-locked (then straight)."""
        def ring() -> torch.Tensor | None:
            assert lease.buffer is not None
            return None if self.pool.is_locked(lease.buffer) else self._page_locked_ring()
        return ring

    def _host_views(self, buf: torch.Tensor, key: Any, offsets: dict[str, int],
                    tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._views.get(buf, None, key, lambda: layout.views(buf, offsets, tensors))

    def _fill(self, snap: Snapshot, key: Any, offsets: dict[str, int],
              tensors: Mapping[str, torch.Tensor], held: dict[str, torch.Tensor]) -> None:
        """On the snapshot thread: allocate the buffer if it is not yet, copy ``held`` into it."""
        t0 = time.perf_counter()
        buf = self.pool.fill(snap.lease)
        if not snap.tensors:
            snap.tensors = self._host_views(buf, key, offsets, tensors)
        with torch.no_grad():
            copy_all((snap.tensors[n], t) for n, t in held.items())
        snap.lazy_s = time.perf_counter() - t0

    def _copy_cuda(self, dev: torch.device, srcs: list[torch.Tensor], names: list[str],
                   offsets: dict[str, int], snap: Snapshot, rng: tuple[int, int],
                   staging: torch.Tensor | None, key: Any) -> None:
        stream = self._stream(dev)
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(dev))
        stream.wait_event(start)
        lo, hi = rng
        safe = torch.cuda.Event()
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), torch.no_grad():
            if staging is not None:
                stage_views = self._views.get(staging, lo, key, lambda: [
                    layout.view(staging, offsets[n] - lo, s)
                    for n, s in zip(names, srcs, strict=True)])
                torch._foreach_copy_(stage_views, srcs, non_blocking=True)
                snap.unstage.append((stream, staging[: hi - lo], lo, hi))
            else:
                for n, s in zip(names, srcs, strict=True):
                    snap.tensors[n].copy_(s, non_blocking=True)
            safe.record(stream)
            done.record(stream)
        self._safe[dev] = safe
        snap.start_events.append(start)
        snap.done_events.append(done)
        snap.sources.extend(srcs)

    def _staging_buffer(self, dev: torch.device, nbytes: int) -> torch.Tensor | None:
        if not self.device_staging:
            return None
        cur = self._staging.get(dev)
        if cur is not None and cur.numel() >= nbytes:
            return cur
        free, _ = torch.cuda.mem_get_info(dev)
        if nbytes > free * 0.9:
            return None  # not enough GPU memory: copy straight to the host buffer
        if cur is not None:
            self._views.forget(cur)
        self._staging[dev] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        return self._staging[dev]

    def release(self, snap: Snapshot) -> None:
        """The persist thread is done with ``snap``: its staging and host buffers are free
        again (also when it failed before emptying them)."""
        if snap.ready is not None:  # its outcome reached the save through wait()
            concurrent.futures.wait([snap.ready])
        snap.staging_free.set()
        self.pool.release(snap.lease)

    def guard(self, found: list[Any]) -> Maps:
        """Make the optimizers (and, with CUDA, the modules) ``found`` in a state (by
        :func:`mpickpt.format.state_tree.flatten_placed`) wait for the snapshot before they
        change the tensors it copies: an optimizer step pre-hook and a forward
        pre-hook, registered once per object. Returns what :meth:`take` asks for only when it
        needs them (lazy copies, CUDA tensors): the CPU tensors only those optimizers change
        (data pointer -> bytes: their parameters and state, which :meth:`take` copies lazily),
        and the data pointers of every tensor those hooks guard (the optimizers' parameters
        and state, the modules' buffers)."""
        @functools.cache
        def maps() -> tuple[dict[int, int], set[int]]:
            owned: dict[int, int] = {}
            guarded: set[int] = set()
            for obj in found:
                if isinstance(obj, torch.optim.Optimizer):
                    owners.owned_by(obj, owned, guarded)
                elif torch.cuda.is_available():
                    guarded.update(owners.buffer_ptrs(obj))
            return owned, guarded
        with self._hook_lock:
            for obj in found:
                if obj in self._hooked:
                    continue
                if isinstance(obj, torch.optim.Optimizer):
                    obj.register_step_pre_hook(lambda *_: self.fence_step())
                elif torch.cuda.is_available():
                    obj.register_forward_pre_hook(lambda *_: self.fence())
                else:
                    continue
                self._hooked.add(obj)
        return maps

    def fence(self) -> None:
        """Make the current stream of each device wait until the last snapshot no longer reads
        the user's tensors (GPU-side; returns at once)."""
        for dev, ev in list(self._safe.items()):
            if ev.query():
                del self._safe[dev]
            else:
                torch.cuda.current_stream(dev).wait_event(ev)

    def fence_step(self) -> None:
        """Before an optimizer step: :meth:`fence`, and wait for the lazy CPU copy."""
        self.fence()
        self._wait_reading()

    def _wait_reading(self) -> None:
        job = self._reading
        if job is not None:
            concurrent.futures.wait([job])  # a failure aborts the save, not the training step
            self._reading = None

    def wait_snapshot(self) -> None:
        """Block the calling thread until the last snapshot no longer reads the user's tensors."""
        for ev in list(self._safe.values()):
            ev.synchronize()
        self._safe.clear()
        self._wait_reading()

