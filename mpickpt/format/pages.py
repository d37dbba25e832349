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

import numpy as np

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int


def address(m: mmap.mmap) -> int:
    """Where a (non-empty) map starts in memory. Use it only while the map is open."""
    return int(np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data)


def populate(base: int, start: int, n: int, write: bool = False) -> bool:
    """Fault bytes ``[start, start + n)`` of the map at ``base`` in (``start`` a multiple of
    the page size), for reading or (``write``) writing; changes no byte. False where the kernel
    cannot (before Linux 5.14) or the range is not mapped (any more): the pages then come in
    at their first touch, as without it."""
    if _madvise is None or n <= 0:
        return _madvise is not None
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return _madvise(base + start, n, advice) == 0
