"""Compressed tensors: one zstd frame per checksum block, as HDF5's registered Zstd filter reads it.

A compressed tensor is stored as a one-dimensional chunked HDF5 dataset whose chunk is one
checksum block of the tensor's bytes, with the filter pipeline ``[shuffle,] zstd`` (HDF5's
built-in byte shuffle, id 2; the Zstd filter, id 32015, registered by ``hdf5plugin``). mpickpt's
own threads compress the blocks (with zstd's own library into reused buffers, else with
``zstandard``; both release the GIL) and HDF5 only places them (direct chunk writes), so h5py
with ``import hdf5plugin`` reads the dataset as an ordinary one.
A chunk holds exactly what that pipeline makes of the block: the bytes byte-shuffled by element
size when ``shuffle``, the last one zero-padded to the chunk's size, then one zstd frame.

Codec names: ``"zstd"`` and ``"zstd+shuffle"``, at :data:`LEVEL`. Torch-free; ``zstandard`` is
imported when a block is first decompressed, or compressed where zstd's library does not load
(``pip install 'mpickpt[compress]'``).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import zstdlib
from .blocks import kept_buffer

CODECS = ("zstd", "zstd+shuffle")
ZSTD_FILTER = 32015  # the HDF5 Zstd filter's registered id (hdf5plugin.Zstd)
LEVEL = 1  # zstd level: the fastest; measured in docs/performance.md
MIN_BYTES = 64 << 10  # smaller tensors are written as they are: a frame would save nothing
NO_ZSTANDARD = ("compression needs the 'zstandard' package: pip install 'mpickpt[compress]' "
                "(and hdf5plugin, for h5py to read compressed shards)")

_local = threading.local()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(NO_ZSTANDARD) from None
    return zstandard


def require() -> None:
    """ImportError saying what to install, unless ``zstandard`` is there."""
    _zstd()


def check(codec: str | None) -> None:
    """ValueError for a codec name mpickpt does not know (None: not compressed)."""
    if codec is not None and codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}, or None")


def chooser(compression: str | Mapping[str, str | None] | None
            ) -> Callable[[str], str | None] | None:
    """Tensor name -> codec from ``compression``: one codec for every tensor, or key paths
    (``{"optim": "zstd+shuffle", "model/embed": None}``; the longest matching prefix, ending
    before ``/`` or ``.``, wins); ValueError naming an unknown codec."""
    if compression is None:
        return None
    if isinstance(compression, str):
        check(compression)
        return lambda name: compression
    rules = {k.strip("/"): v for k, v in compression.items()}
    for v in rules.values():
        check(v)

    def pick(name: str) -> str | None:
        best = None
        for k in rules:
            if (name == k or name.startswith((k + "/", k + ".")) or not k) and \
                    (best is None or len(k) > len(best)):
                best = k
        return None if best is None else rules[best]

    return pick


def chunk_elements(nbytes: int, itemsize: int, block: int) -> int:
    """Elements per HDF5 chunk: one checksum block, or the whole tensor when it is smaller."""
    return min(block // itemsize, nbytes // itemsize)


def compress(codec: str, raw: memoryview, chunk_bytes: int, itemsize: int) -> bytes:
    """One block's chunk: ``raw`` (at most ``chunk_bytes``) zero-padded to ``chunk_bytes``,
    byte-shuffled for ``zstd+shuffle``, as one zstd frame."""
    out = mmap.mmap(-1, max_frame(chunk_bytes), flags=mmap.MAP_PRIVATE)
    return out[:compress_into(codec, raw, chunk_bytes, itemsize, memoryview(out))]


def compress_into(codec: str, raw: memoryview, chunk_bytes: int, itemsize: int,
                  out: memoryview) -> int:
    """:func:`compress` written into ``out`` (writable, at least :func:`max_frame` bytes): the
    frame's length. With zstd's own library (:mod:`mpickpt.format.zstdlib`) nothing is
    allocated, a short block is padded by zeros that cost no memory, and the GIL is released
    for the whole compression; else ``zstandard`` makes the frame and it is copied."""
    shuffle = codec == "zstd+shuffle" and itemsize > 1
    if zstdlib.lib() is None:
        frame = _zstandard_frame(raw, chunk_bytes, itemsize, shuffle)
        np.copyto(np.frombuffer(out, np.uint8)[:len(frame)], np.frombuffer(frame, np.uint8))
        return len(frame)
    src = np.frombuffer(raw, np.uint8)
    if shuffle:  # this thread's buffer: the padded block's bytes, element byte by byte
        buf = np.frombuffer(kept_buffer(_local, "shuffle", chunk_bytes), np.uint8)[:chunk_bytes]
        planes = buf.reshape(itemsize, -1)
        np.copyto(planes[:, :len(raw) // itemsize], src.reshape(-1, itemsize).T)
        planes[:, len(raw) // itemsize:] = 0
        pieces = [(int(buf.ctypes.data), chunk_bytes)]
    else:
        pieces = [(int(src.ctypes.data), len(raw))] if len(raw) else []
        if len(raw) < chunk_bytes:
            pieces.append((zstdlib.zeros(chunk_bytes - len(raw)), chunk_bytes - len(raw)))
    dst = np.frombuffer(out, np.uint8)
    return zstdlib.compress(pieces, int(dst.ctypes.data), len(dst), LEVEL)


def _zstandard_frame(raw: memoryview, chunk_bytes: int, itemsize: int, shuffle: bool) -> bytes:
    data: Any = raw
    if len(raw) < chunk_bytes:
        padded = bytearray(chunk_bytes)
        padded[: len(raw)] = raw
        data = padded
    if shuffle:
        data = np.frombuffer(data, np.uint8).reshape(-1, itemsize).T.tobytes()
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = _zstd().ZstdCompressor(level=LEVEL, write_content_size=True)
    return c.compress(data)


def decompress(codec: str, frame: bytes | bytearray | memoryview, out: memoryview,
               chunk_bytes: int, itemsize: int) -> None:
    """Decompress one chunk into ``out`` (the block's first ``len(out)`` bytes); ValueError when
    the frame does not decompress to ``chunk_bytes`` bytes (damage). Without shuffle the frame
    is decompressed straight into ``out``."""
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = _zstd().ZstdDecompressor()
    try:
        if codec == "zstd+shuffle" and itemsize > 1:
            data = d.decompress(frame, max_output_size=chunk_bytes)
            got = len(data)
        else:
            data = None
            reader = d.stream_reader(frame)
            got = _readinto(reader, out)
            if got == len(out):  # read on: the last block's padding, and nothing beyond
                while got <= chunk_bytes and (more := reader.read(chunk_bytes + 1 - got)):
                    got += len(more)
    except Exception as e:  # zstandard.ZstdError: a damaged frame
        raise ValueError(f"the compressed chunk does not decompress: {e}") from None
    if got != chunk_bytes:
        raise ValueError(f"the compressed chunk holds {got} bytes, not {chunk_bytes}")
    if data is not None:
        arr = np.frombuffer(data, np.uint8).reshape(itemsize, -1).T
        np.copyto(np.frombuffer(out, np.uint8), arr.reshape(-1)[: len(out)])


def _readinto(reader: Any, out: memoryview) -> int:
    """Fill ``out`` from a zstd stream reader; the bytes read (fewer at the frame's end)."""
    got = 0
    while got < len(out):
        n = reader.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def max_frame(chunk_bytes: int) -> int:
    """The largest frame a chunk of ``chunk_bytes`` can need (zstd's bound, rounded up)."""
    return chunk_bytes + (chunk_bytes >> 7) + 4096
