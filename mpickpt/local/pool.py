"""Recycled files of the node-local level: no fresh pages on the hot path.

A step that retention retires leaves its files in ``LOCAL/<node>/.pool/`` under their names
(``rank-RRRRR.h5``, ``xor-RRRRR.bin``: :func:`mpickpt.local.nodedir.retire`) instead of being
deleted, and the next save of the same name takes the file back (a rename) and writes over it.
A node holds at most ``keep + 1`` steps' worth of bytes, as before: the ``keep`` committed ones
and the one being written, whose files come from the pool.

The rank that writes a file keeps it memory-mapped between saves (:class:`Maps`, by inode): the
next save of that name writes into pages that are allocated and already in its page tables. A
new file is allocated in full first (``posix_fallocate``), so that a full tmpfs is an error
before the copy rather than a SIGBUS in it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import torch

from ..format import rootdir

MAX_MAPS = 16  # files a rank keeps mapped between saves (shard, copy or parity, per kept step)


class Mapped:
    """One file of the level, open read-write and mapped (a
    :class:`~mpickpt.format.shard.Destination`)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return len(self._map) if self._map is not None else 0

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The file grown to ``nbytes`` at least (its blocks allocated), its first ``nbytes``
        as a writable uint8 tensor over the map."""
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            try:
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                raise OSError(e.errno, e.strerror, self.path) from e
        if nbytes > self.capacity:
            self._unmap()
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        if self._bytes is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._bytes[:nbytes]

    def view(self, off: int, n: int) -> memoryview:
        """Bytes ``[off, off + n)`` of the map (reserved before), for MPI to send or fill."""
        assert self._bytes is not None
        return memoryview(self._bytes[off:off + n].numpy())

    def _unmap(self) -> None:
        self._bytes = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # MPI may still hold a view: it goes with it
                self._map.close()
            self._map = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


class Maps:
    """This rank's files of the level kept mapped between saves, by inode (at most
    :data:`MAX_MAPS`; one whose file was deleted is let go)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], Mapped] = {}
        self._lock = threading.Lock()

    def take(self, pool_dir: str, directory: str, name: str) -> Mapped:
        """The file ``directory/name``, made from the pool's file of that name when there is
        one, else created; open and mapped (:meth:`Mapped.reserve` sizes it)."""
        path = os.path.join(directory, name)
        try:
            os.rename(os.path.join(pool_dir, name), path)
        except FileNotFoundError:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                             rootdir.file_mode(path)))
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        st = os.fstat(fd)
        with self._lock:
            self._forget_deleted()
            known = self._maps.pop((st.st_dev, st.st_ino), None)
            if known is not None:
                os.close(known.fd)
                known.fd, known.path = fd, path
            else:
                known = Mapped(fd, path)
            self._maps[st.st_dev, st.st_ino] = known
            while len(self._maps) > MAX_MAPS:
                self._maps.pop(next(iter(self._maps))).close()
        return known

    def _forget_deleted(self) -> None:
        for key, m in list(self._maps.items()):
            if os.fstat(m.fd).st_nlink == 0:
                self._maps.pop(key).close()

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
