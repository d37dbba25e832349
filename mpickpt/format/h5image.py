"""A shard's HDF5 metadata, laid out in memory: the file less its tensors' bytes.

HDF5 lays a shard out (:class:`~mpickpt.format.shard.ShardWriter`) through this file object
instead of a file. It holds every byte HDF5 writes, and ``extents`` gives them back, less the
ranges of the tensors' data (bytes HDF5 may have written there before it allocated the dataset
are stale and would overwrite the data). The tensors' bytes go straight into the destination
(a recycled, mapped file of the node-local level), and so can the partner's copy of them, while
the metadata is a few kilobytes that follow once the shard is sealed.
"""

from __future__ import annotations

import io
import os
from bisect import bisect_right
from collections.abc import Iterable, Iterator

from .blocks import pwrite_all

PAGE = 4096


class HDF5File(io.RawIOBase):
    """What h5py's file-object driver needs of a file besides reading and writing: a position,
    seeking from the start, the position or the end (``size``), and no buffering."""

    def __init__(self, size: int = 0) -> None:
        super().__init__()
        self._pos = 0
        self.size = size  # the file's end

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass


class MetadataImage(HDF5File):
    """A sparse in-memory file for h5py's file-object driver; unwritten bytes read as zeros.
    ``size`` is the file's end (HDF5 truncates it to its end of allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self._pages: dict[int, bytearray] = {}
        self._spans: list[tuple[int, int]] = []  # written [start, end), in write order

    def write(self, data: object) -> int:
        b = memoryview(data).cast("B")  # type: ignore[arg-type]
        pos, n = self._pos, len(b)
        done = 0
        while done < n:
            page, at = divmod(pos + done, PAGE)
            take = min(PAGE - at, n - done)
            self._pages.setdefault(page, bytearray(PAGE))[at:at + take] = b[done:done + take]
            done += take
        if n:
            self._spans.append((pos, pos + n))
        self._pos = pos + n
        self.size = max(self.size, self._pos)
        return n

    def readinto(self, buf: object) -> int:
        out = memoryview(buf).cast("B")  # type: ignore[arg-type]
        n = max(0, min(len(out), self.size - self._pos))
        self._copy(self._pos, out[:n])
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        self.size = self._pos if size is None else size
        return self.size

    def _copy(self, pos: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            page, at = divmod(pos + done, PAGE)
            take = min(PAGE - at, len(out) - done)
            src = self._pages.get(page)
            out[done:done + take] = src[at:at + take] if src is not None else bytes(take)
            done += take

    def extents(self, data: list[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
        """Every byte written below the file's end, as ``(offset, bytes)`` runs, less the
        ranges ``data`` ((offset, length) of the tensors' bytes)."""
        holes = sorted((o, o + n) for o, n in data if n)
        starts = [a for a, _ in holes]
        for lo, hi in _merged(self._spans, self.size):
            # the data ranges that may overlap [lo, hi): from the last one starting before it
            i = max(0, bisect_right(starts, lo) - 1)
            at = lo
            while at < hi:
                while i < len(holes) and holes[i][1] <= at:
                    i += 1
                if i < len(holes) and holes[i][0] <= at:
                    at = holes[i][1]
                    continue
                end = min(hi, holes[i][0]) if i < len(holes) else hi
                out = bytearray(end - at)
                self._copy(at, memoryview(out))
                yield at, bytes(out)
                at = end


def _merged(spans: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The union of ``spans``, clipped to ``end``, in order."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        hi = min(hi, end)
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def padding(size: int, written: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` of the bytes below ``size`` that no ``(offset, length)`` of
    ``written`` covers, in order."""
    out: list[tuple[int, int]] = []
    at = 0
    for lo, hi in _merged([(o, o + n) for o, n in written if n], size):
        if lo > at:
            out.append((at, lo - at))
        at = max(at, hi)
    if at < size:
        out.append((at, size - at))
    return out


def place(fd: int, runs: Iterable[tuple[int, bytes | memoryview]], size: int) -> None:
    """Write each ``(offset, bytes)`` run of a shard's metadata (:meth:`MetadataImage.extents`)
    into the file ``fd``, around its tensors' bytes, and end the file at ``size``."""
    for off, data in runs:
        pwrite_all(fd, memoryview(data), off)
    os.ftruncate(fd, size)
