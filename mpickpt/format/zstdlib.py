"""zstd's own C library through ctypes: a block compressed straight into a buffer the caller
reuses, with the GIL released for the whole call.

``zstandard``'s ``compress`` returns a new ``bytes`` per frame, and freeing a 64 MiB one unmaps
it while the GIL is held (3.8 ms on the H200 host, 87 times per save of the reference job): the
training loop waited behind it (docs/performance.md). Here each thread keeps one compression
context and writes each frame into the buffer it is given. The library is the copy inside the
``zstandard`` wheel, or the system's ``libzstd.so.1``; where neither loads, :func:`lib` is None
and :mod:`mpickpt.format.codec` compresses with ``zstandard``'s own API.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import mmap
import os
import threading
from collections.abc import Sequence

from . import pages

_c_void_p, _c_size_t, _c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
MIN_VERSION = 10400  # 1.4.0: the first with ZSTD_compress2 and ZSTD_compressStream2 stable
_LEVEL, _END, _CONTINUE, _RESET_SESSION = 100, 2, 0, 1  # the zstd.h constants used here


class _InBuffer(ctypes.Structure):
    _fields_ = [("src", _c_void_p), ("size", _c_size_t), ("pos", _c_size_t)]


class _OutBuffer(ctypes.Structure):
    _fields_ = [("dst", _c_void_p), ("size", _c_size_t), ("pos", _c_size_t)]


_lib: ctypes.CDLL | None = None
_loaded = False
_load_lock = threading.Lock()
_local = threading.local()
_zeros: list[mmap.mmap] = []  # never written: its pages are the kernel's shared zero page


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None where it is missing or older than 1.4."""
    global _lib, _loaded
    with _load_lock:
        if not _loaded:
            _loaded, _lib = True, _load()
    return _lib


def candidates() -> list[str]:
    """Where to look: the copy of zstd inside ``zstandard``'s wheel (its cffi module exports
    the library's functions), then the system's ``libzstd.so.1`` (dlopen's search path; no
    ``find_library``, which starts a subprocess)."""
    found = []
    spec = importlib.util.find_spec("zstandard")
    for where in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(where, "_cffi*.so")))
    return [*found, "libzstd.so.1"]


def _load() -> ctypes.CDLL | None:
    for name in candidates():
        try:
            z = ctypes.CDLL(name)
            z.ZSTD_versionNumber.restype = ctypes.c_uint
            if z.ZSTD_versionNumber() >= MIN_VERSION:
                return _declare(z)
        except (OSError, AttributeError):  # not loadable, or not zstd: the next one
            continue
    return None


def _declare(z: ctypes.CDLL) -> ctypes.CDLL:
    z.ZSTD_createCCtx.restype = _c_void_p
    z.ZSTD_freeCCtx.argtypes = [_c_void_p]
    z.ZSTD_isError.argtypes, z.ZSTD_isError.restype = [_c_size_t], ctypes.c_uint
    z.ZSTD_getErrorName.argtypes, z.ZSTD_getErrorName.restype = [_c_size_t], ctypes.c_char_p
    z.ZSTD_CCtx_reset.argtypes, z.ZSTD_CCtx_reset.restype = [_c_void_p, _c_int], _c_size_t
    z.ZSTD_CCtx_setParameter.argtypes = [_c_void_p, _c_int, _c_int]
    z.ZSTD_CCtx_setParameter.restype = _c_size_t
    z.ZSTD_CCtx_setPledgedSrcSize.argtypes = [_c_void_p, ctypes.c_ulonglong]
    z.ZSTD_CCtx_setPledgedSrcSize.restype = _c_size_t
    z.ZSTD_compress2.argtypes = [_c_void_p, _c_void_p, _c_size_t, _c_void_p, _c_size_t]
    z.ZSTD_compress2.restype = _c_size_t
    z.ZSTD_compressStream2.argtypes = [_c_void_p, ctypes.POINTER(_OutBuffer),
                                       ctypes.POINTER(_InBuffer), _c_int]
    z.ZSTD_compressStream2.restype = _c_size_t
    return z


class _Context:
    """One thread's compression context, freed with the thread's locals."""

    def __init__(self, z: ctypes.CDLL) -> None:
        self.z, self.ptr = z, z.ZSTD_createCCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createCCtx failed")

    def __del__(self) -> None:
        if self.ptr:
            self.z.ZSTD_freeCCtx(self.ptr)


def _check(z: ctypes.CDLL, r: int) -> int:
    if z.ZSTD_isError(r):
        raise ValueError(f"zstd: {z.ZSTD_getErrorName(r).decode()}")
    return r


def zeros(n: int) -> int:
    """The address of ``n`` zero bytes that cost no memory (an anonymous map never written)."""
    with _load_lock:
        if not _zeros or len(_zeros[-1]) < n:
            _zeros.append(mmap.mmap(-1, max(n, 1), mmap.MAP_PRIVATE, mmap.PROT_READ))
        m = _zeros[-1]
    return pages.address(m)


def compress(pieces: Sequence[tuple[int, int]], dst: int, capacity: int, level: int) -> int:
    """One zstd frame of the bytes at ``pieces`` (address, length; one after another) written at
    address ``dst`` (``capacity`` bytes, at least zstd's bound); its length. The frame records
    its content size, as ``zstandard``'s ``compress(write_content_size=True)`` does."""
    z = lib()
    if z is None:
        raise RuntimeError("libzstd.so.1 is not loaded")
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = _Context(z)
    c = ctx.ptr
    _check(z, z.ZSTD_CCtx_reset(c, _RESET_SESSION))
    _check(z, z.ZSTD_CCtx_setParameter(c, _LEVEL, level))
    if len(pieces) == 1:  # one buffer: compressed in one call, without the stream's copy
        return _check(z, z.ZSTD_compress2(c, dst, capacity, pieces[0][0], pieces[0][1]))
    _check(z, z.ZSTD_CCtx_setPledgedSrcSize(c, sum(n for _, n in pieces)))
    out = _OutBuffer(dst, capacity, 0)
    for k, (addr, n) in enumerate(pieces):
        inp, last = _InBuffer(addr, n, 0), k == len(pieces) - 1
        while True:
            left = _check(z, z.ZSTD_compressStream2(c, ctypes.byref(out), ctypes.byref(inp),
                                                    _END if last else _CONTINUE))
            if (left == 0 if last else inp.pos == inp.size):
                break
            if out.pos == out.size:
                raise ValueError(f"zstd: the frame outgrew its {capacity}-byte buffer")
    return out.pos
