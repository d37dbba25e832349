"""A memory map's pages brought in ahead of their use, without holding Python's lock.

``mmap.mmap.madvise`` keeps the GIL for the whole call: populating a 2 GB shard file in 64 MiB
pieces then stops every other thread of the rank for most of 0.2 s, the transfer thread about to
post its first blocks included (the XOR rebuild on an H200 host started 0.19-0.25 s late
because of it). The call here goes to the C library through :mod:`ctypes`, which lets the lock
go while the kernel works.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

MADV_DONTNEED = 4
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int


def address(m: object) -> int:
    """Where a non-empty map, or any other bytes-like object (read-only ones too), starts in
    memory. Use it only while the object is alive (a map: open)."""
    return int(np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data)  # type: ignore[call-overload]


def populate(base: int, start: int, n: int, write: bool = False) -> bool:
    """Fault bytes ``[start, start + n)`` of the map at ``base`` in (``start`` a multiple of
    the page size), for reading or (``write``) writing; changes no byte. False where the kernel
    cannot (before Linux 5.14) or the range is not mapped (any more): the pages then come in
    at their first touch, as without it."""
    if _madvise is None or n <= 0:
        return _madvise is not None
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return _madvise(base + start, n, advice) == 0


def unmap(m: mmap.mmap, piece: int = 64 << 20) -> None:
    """Close a shared map of a file, its pages let go first piece by piece
    (``MADV_DONTNEED``: the file keeps its bytes). Unmapped at once, 2-3 GB of pages mapped in
    took 60-100 ms with the process's memory map locked against every other change, the CUDA
    driver's included: a restore's last steps waited for a map closed behind them."""
    if _madvise is not None and len(m):
        base = address(m)
        for a in range(0, len(m), piece):
            _madvise(base + a, min(piece, len(m) - a), MADV_DONTNEED)
    m.close()


def resident(base: int, n: int) -> int:
    """How many pages of the ``n`` bytes from ``base`` (page-aligned, mapped) are in memory
    (``mincore``, which brings none in): of a file's map, those in the page cache. OSError
    where the kernel cannot tell."""
    count = -(-n // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * count)()
    if _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(n), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return sum(b & 1 for b in vec)
