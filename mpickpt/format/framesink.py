"""The file object HDF5 writes a compressed shard through: its metadata goes to the file, each
compressed chunk's bytes are left for mpickpt's threads to write with ``O_DIRECT``.

HDF5 places a directly written chunk (``H5Dwrite_chunk``) and indexes it; only it knows where.
Through h5py's file-object driver its writes come here: :meth:`FrameSink.expect` names the
frame about to be handed over (its address and length), the one write of exactly that buffer
is not made but noted (:meth:`FrameSink.taken`: its offset), and the caller writes the frame
there itself (:func:`write_frame`), on another thread, bypassing the page cache as a raw
shard's tensors do. Through the page cache, gigabytes of frames were flushed at the seal's
``fsync``, and the training loop stopped for 0.1-0.2 s then on the H200 (docs/performance.md).
"""

from __future__ import annotations

import mmap
import os
import queue
from concurrent.futures import Executor, Future, wait
from typing import Any

from .blocks import DIRECT_ALIGN, _address, _pwrite, align, pwrite_all
from .h5image import HDF5File
from .pages import address


class FrameSink(HDF5File):
    """A file object over ``fd`` for h5py: reads and writes at the position, but for the one
    write of the buffer :meth:`expect` names, which is noted, not made."""

    def __init__(self, fd: int) -> None:
        super().__init__(os.fstat(fd).st_size)
        self.fd = fd
        self._expect: tuple[int, int] | None = None
        self._taken: int | None = None

    def expect(self, frame: bytes) -> None:
        """The next write of ``frame``'s own bytes is the caller's to make."""
        self._expect, self._taken = (address(frame), len(frame)), None

    def taken(self) -> int | None:
        """Where the expected frame goes, if HDF5 handed it here unwritten (else HDF5 wrote a
        copy itself, and the caller writes nothing)."""
        at, self._taken, self._expect = self._taken, None, None
        return at

    def write(self, data: object) -> int:
        b = memoryview(data).cast("B")  # type: ignore[arg-type]
        n = len(b)
        if self._expect is not None and n and (address(b), n) == self._expect:
            self._taken, self._expect = self._pos, None
        else:
            pwrite_all(self.fd, b, self._pos)
        self._pos += n
        self.size = max(self.size, self._pos)
        return n

    def readinto(self, buf: object) -> int:
        out = memoryview(buf).cast("B")  # type: ignore[arg-type]
        got = os.preadv(self.fd, [out], self._pos)
        self._pos += got
        return got

    def truncate(self, size: int | None = None) -> int:
        self.size = self._pos if size is None else size
        os.ftruncate(self.fd, self.size)
        return self.size


class AlignedBuffers:
    """Page-aligned buffers of ``capacity`` bytes, made when none is free and kept for reuse:
    as many as frames are in flight at once (:func:`buffers`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = align(capacity, DIRECT_ALIGN)
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self.made = 0  # buffers mapped so far

    def take(self) -> mmap.mmap:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            self.made += 1
            return mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE)

    def give(self, buf: mmap.mmap) -> None:
        self._free.put(buf)


_BUFFERS: dict[int, AlignedBuffers] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BUFFERS.clear)


def buffers(capacity: int) -> AlignedBuffers:
    """The process's frame buffers of ``capacity`` bytes, kept from one save to the next: a
    fresh 64 MiB buffer faults its pages in, and unmapping one held the GIL for 3.8 ms on the
    H200 host (docs/performance.md)."""
    return _BUFFERS.setdefault(align(capacity, DIRECT_ALIGN), AlignedBuffers(capacity))


def write_frame(fd: int, dfd: int, buf: mmap.mmap, n: int, offset: int,
                pool: AlignedBuffers) -> None:
    """Write the frame in ``buf``'s first ``n`` bytes at ``offset`` (its aligned part with
    ``O_DIRECT`` on ``dfd``, ``-1``: none; the rest through the page cache on ``fd``), then give
    ``buf`` back to ``pool``."""
    view = memoryview(buf)
    _pwrite(fd, dfd, _address(view), view[:n], offset)
    view.release()
    pool.give(buf)


class FrameWriter:
    """Hands each frame to HDF5 (``write_direct_chunk``: placed and indexed) and writes the bytes
    ``sink`` was left on ``workers`` (None: here), at most ``ahead`` frames in flight."""

    def __init__(self, sink: FrameSink | None, fd: int, dfd: int, capacity: int,
                 workers: Executor | None, ahead: int) -> None:
        self.sink, self.fd, self.dfd, self.workers, self.ahead = sink, fd, dfd, workers, ahead
        self.buffers = buffers(capacity)
        self._writes: list[Future[None]] = []

    def put(self, dataset: Any, coords: tuple[int, ...], buf: mmap.mmap, n: int) -> None:
        """Hand the frame in ``buf``'s first ``n`` bytes (a buffer of :attr:`buffers`, given
        back once written) to HDF5, and write it where HDF5 placed it."""
        frame = memoryview(buf)[:n]
        if self.sink is not None:
            self.sink.expect(frame)
        dataset.write_direct_chunk(coords, frame)
        frame.release()
        at = self.sink.taken() if self.sink is not None else None
        if at is None:  # HDF5 wrote it
            self.buffers.give(buf)
            return
        args = (self.fd, self.dfd, buf, n, at, self.buffers)
        if self.workers is None:
            write_frame(*args)
            return
        self._writes.append(self.workers.submit(write_frame, *args))
        while len(self._writes) > self.ahead:
            self._writes.pop(0).result()

    def finish(self) -> None:
        """Until every frame is written; the first error raised."""
        while self._writes:
            self._writes.pop(0).result()

    def abandon(self) -> None:
        """Cancel the writes not started and wait for the others (they use the caller's
        descriptors); their errors are dropped: the caller is failing already."""
        for f in self._writes:
            f.cancel()
        wait(self._writes)
        self._writes = []
