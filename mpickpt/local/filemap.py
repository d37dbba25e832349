"""Files of the node-local level as memory maps, for the redundancy's transfers out of and into
them; and the first error of one side of a transfer, kept while the transfer goes on.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..format import iothreads, pages, rootdir
from ..format.iothreads import pool
from .xorring import Parts

POPULATE_PIECE = 64 << 20
POPULATORS = 4  # the maps populated at once, at most (an XOR rebuild's member: 2)


def _populators() -> ThreadPoolExecutor:
    return pool(POPULATORS, False, "populate")


def prestart() -> None:
    """The threads that populate maps made now (:func:`mpickpt.format.iothreads.prestart`)."""
    iothreads.prestart(_populators(), POPULATORS)


class FileMap:
    """A file as a shared memory map (``create``: made, its blocks allocated first, so that a
    full disk is an error here rather than a SIGBUS later; fsynced when it closes)."""

    def __init__(self, path: str, size: int, create: bool = False) -> None:
        self.path, self.size, self.create = path, size, create
        self._map: mmap.mmap | None = None
        self._arr: np.ndarray | None = None
        self._populating: Future[None] | None = None

    def __enter__(self) -> FileMap:
        if self.create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                         rootdir.file_mode(self.path))
        else:
            fd = rootdir.open_regular(self.path)
        self.fd = fd
        try:
            if self.size:
                if self.create:
                    os.posix_fallocate(fd, 0, self.size)
                self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | (
                    mmap.PROT_WRITE if self.create else 0))
                self._arr = np.frombuffer(self._map, dtype=np.uint8)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, e.strerror, self.path) from e
        except ValueError:  # a file shorter than the map (a truncated copy): an OSError too
            os.close(fd)
            raise OSError(errno.EINVAL, f"shorter than the {self.size} bytes expected",
                          self.path) from None
        return self

    def view(self, off: int, n: int) -> np.ndarray:
        assert self._arr is not None
        return self._arr[off:off + n]

    def populate(self) -> None:
        """Map the file's pages in ahead of their use, on a thread of their own, from the start
        (``MADV_POPULATE_WRITE``/``_READ``, Linux 5.14): MPI's copies into them and the XOR's
        reads then take no page fault at each page. Where the kernel cannot, nothing happens;
        the map is closed only after it (``__exit__``)."""
        if self._map is None:
            return
        base, write = pages.address(self._map), self.create

        def run() -> None:  # (the map stays open until this ends: __exit__ joins it)
            for a in range(0, self.size, POPULATE_PIECE):
                if not pages.populate(base, a, min(POPULATE_PIECE, self.size - a), write):
                    return  # an older kernel: the pages come in at their first touch

        self._populating = _populators().submit(run)

    def __exit__(self, *exc: object) -> None:
        if self._populating is not None:
            self._populating.result()
        self._arr = None
        if self._map is not None:
            if self.create:
                _unmap(self._map)
            else:  # read: unmapped on a low-priority thread, nothing waits for it (a
                pool(1, background=True).submit(_unmap, self._map)  # 2 GB shard: 0.06-0.1 s)
            self._map = None
        try:
            if self.create:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _unmap(m: mmap.mmap) -> None:
    # MPI may still hold a view of it: then the map goes with its last reference
    with contextlib.suppress(BufferError):
        pages.unmap(m)


class Keep:
    """The first error of the local side of an exchange; the transfers go on regardless, so
    that a peer never waits for a window this rank would not send."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def do(self, fn: Callable[..., object], *args: object) -> None:
        if self.error is None:
            try:
                fn(*args)
            except Exception as e:
                self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def file_parts(src: FileMap | None, start: int, n: int) -> Parts:
    """Bytes ``[start, start + n)`` of a file mapped read-only, where they lie, as the runs of
    a ring's block (:mod:`mpickpt.local.xorring`); none past the file's end (zeros), nor for
    no file."""
    have = 0 if src is None else max(0, min(n, src.size - start))
    return [(0, src.view(start, have))] if have and src is not None else []
