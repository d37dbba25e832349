"""Verified reads of a shard's checksum blocks: the one reader restore, export and the CLI share.

:class:`BlockFile` opens a shard (no symbolic link, exactly the size the manifest records) and
:meth:`BlockFile.read_block` reads one checksum block of a record with positional reads into a
buffer the caller gives, computes its xxh3-64 and compares it with the record's, raising
:class:`ShardError` naming rank, file, tensor, block and byte range at a mismatch. The caller
chooses the threads (several may read blocks of one file at once) and the buffers: restore reads
each block straight into its place in the tensor (no copy), or small tensors' blocks a run at a
time (:meth:`BlockFile.read_run`, each checked by :meth:`BlockFile.check_block`), verification
streams a block of any size through a small reused buffer.

With ``direct``, the part of a transfer whose buffer address, file offset and length are aligned
to :data:`DIRECT_ALIGN` bypasses the page cache (``O_DIRECT``), the rest goes through it.

Torch-, numpy- and h5py-free, so that the operator's tools can verify a checkpoint without them.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import ShardError
from . import checksum
from .records import TensorRecord, check_records, open_shard

DIRECT_ALIGN = 4096  # O_DIRECT needs buffer address, file offset and length aligned to this
ALIGN = 4096  # every tensor in a host buffer starts on a page boundary (O_DIRECT-friendly)


def align(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a



RUN_BYTES = 8 << 20  # the most a run of small records read at once spans (read_spans)


def kept_buffer(local: threading.local, name: str, n: int, usual: int = 0) -> mmap.mmap:
    """This thread's buffer ``name`` in ``local``, of at least ``n`` bytes (``usual`` when it is
    first made), kept for the thread's next call: an anonymous map, whose pages are faulted in
    by whatever first writes them, outside the GIL (a ``bytearray`` is zeroed under it)."""
    have = getattr(local, name, None)
    if have is None or len(have) < n:
        have = mmap.mmap(-1, max(n, usual, 1), flags=mmap.MAP_PRIVATE)
        setattr(local, name, have)
    return have


def _open_direct(path: str, flags: int) -> int:
    """An O_DIRECT descriptor of ``path``, or -1 where the platform or file system has none."""
    try:
        return os.open(path, flags | os.O_DIRECT)
    except (AttributeError, OSError):
        return -1


def _direct_len(dfd: int, addr: int, offset: int, n: int) -> int:
    """How many leading bytes of a transfer can bypass the page cache."""
    if dfd < 0 or addr % DIRECT_ALIGN or offset % DIRECT_ALIGN:
        return 0
    return n - n % DIRECT_ALIGN


def _address(buf: memoryview) -> int:
    """The address of a writable, non-empty, contiguous buffer (no copy)."""
    import ctypes  # only the O_DIRECT path needs it (restore), not the CLI's start

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _pread_all(fd: int, buf: memoryview, offset: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _pwrite(fd: int, dfd: int, addr: int, buf: memoryview, offset: int) -> None:
    """Write ``buf`` (at address ``addr``) at ``offset``: the aligned part with O_DIRECT on
    ``dfd``, the rest through the page cache on ``fd``."""
    d = _direct_len(dfd, addr, offset, len(buf))
    while d:
        n = os.pwrite(dfd, buf[:d], offset)
        buf, offset, d = buf[n:], offset + n, d - n
        if n % DIRECT_ALIGN:  # a short odd-sized write: finish through the page cache
            break
    pwrite_all(fd, buf, offset)


def _pread(fd: int, dfd: int, addr: int, buf: memoryview, offset: int) -> int:
    """Read ``buf`` (at address ``addr``) from ``offset``: the aligned part with O_DIRECT on
    ``dfd``, the rest through the page cache on ``fd``; the number of bytes read (fewer only at
    the end of the file)."""
    d = _direct_len(dfd, addr, offset, len(buf))
    got = 0
    if d:
        got = os.preadv(dfd, [buf[:d]], offset)
        if got % DIRECT_ALIGN:  # short read at the end of the file
            return got
    return got + _pread_all(fd, buf[got:], offset + got)


class BlockFile:
    """Rank ``rank``'s shard ``path``, open for verified reads of its checksum blocks.

    Opened without following symbolic links, refused (FIFO, device, directory: OSError; another
    size than ``file_bytes``: :class:`ShardError`) before anything is read. The records given to
    :meth:`read_block` must have passed :func:`mpickpt.format.records.check_records`. Thread-safe:
    only positional reads."""

    def __init__(self, rank: int, path: str, file_bytes: int, block: int, *,
                 direct: bool = False) -> None:
        self.rank, self.path, self.block = rank, path, block
        self._scratch = threading.local()  # each reading thread's buffers: compressed chunks, runs
        self.fd = open_shard(rank, path, file_bytes)
        self.dfd = -1
        if direct:
            self.dfd = _open_direct(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            # (st_ino, st_dev): the name may have been replaced since fd was opened
            if self.dfd >= 0 and os.fstat(self.dfd)[1:3] != os.fstat(self.fd)[1:3]:
                os.close(self.dfd)
                self.dfd = -1

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1

    def __enter__(self) -> BlockFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def block_size(self, r: TensorRecord, n: int) -> int:
        """The bytes in block ``n`` of ``r`` (the last one may be short, an empty record has one
        empty block)."""
        return max(0, min(self.block, r.nbytes - n * self.block))

    def read_block(self, r: TensorRecord, n: int, buf: memoryview) -> int:
        """Read checksum block ``n`` of record ``r`` into the writable buffer ``buf`` and verify
        it; the block's size in bytes. When ``buf`` holds the whole block, the block is left in
        ``buf[:size]``; when it is smaller, the block streams through it piece by piece (its
        contents are then the last piece). :class:`ShardError` at the end of the file or a
        checksum mismatch."""
        size = self.block_size(r, n)
        if r.codec is not None:
            return self._read_compressed(r, n, buf, size)
        where = r.offset + n * self.block
        addr = _address(buf) if self.dfd >= 0 and len(buf) else 0
        if len(buf) >= size:
            view = buf[:size]
            if _pread(self.fd, self.dfd, addr, view, where) < size:
                raise ShardError(self.rank, self.path, "unexpected end of file", tensor=r.name)
            digest = checksum.digest(view)
        elif not len(buf):
            raise ValueError("an empty buffer cannot hold a non-empty block")
        else:
            h = xxhash.xxh3_64()
            got = 0
            while got < size:
                view = buf[: min(len(buf), size - got)]
                k = _pread(self.fd, self.dfd, addr, view, where + got)
                if k < len(view):
                    raise ShardError(self.rank, self.path, "unexpected end of file",
                                     tensor=r.name)
                h.update(view)
                got += k
            digest = h.hexdigest()
        if digest != r.checksums[n]:
            raise self._corrupt(r, n, where, size)
        return size

    def _corrupt(self, r: TensorRecord, n: int, where: int, size: int) -> ShardError:
        return ShardError(self.rank, self.path, f"checksum mismatch in block {n} (bytes {where}.."
                          f"{where + size}): the data is corrupt", tensor=r.name)

    def read_run(self, lo: int, hi: int, name: str) -> memoryview:
        """Bytes ``lo..hi`` of the file, through the page cache, in this thread's scratch
        buffer (valid until its next run); ``name``: the first tensor they hold, named by the
        :class:`ShardError` at the end of the file."""
        buf = self._buffer("run", hi - lo, RUN_BYTES)
        if _pread_all(self.fd, buf, lo) < hi - lo:
            raise ShardError(self.rank, self.path, "unexpected end of file", tensor=name)
        return buf

    def check_block(self, r: TensorRecord, n: int, data: memoryview) -> None:
        """Verify ``data``, block ``n`` of uncompressed record ``r`` whole, read by
        :meth:`read_run`; :class:`ShardError` on a checksum mismatch."""
        if checksum.digest(data) != r.checksums[n]:
            raise self._corrupt(r, n, r.offset + n * self.block, len(data))

    def _buffer(self, name: str, n: int, usual: int) -> memoryview:
        """``n`` bytes of this thread's buffer ``name`` for this file (:func:`kept_buffer`: a
        ``bytearray`` per chunk serialised a compressed restore's threads,
        docs/performance.md)."""
        return memoryview(kept_buffer(self._scratch, name, n, usual))[:n]

    def _read_compressed(self, r: TensorRecord, n: int, buf: memoryview, size: int) -> int:
        """:meth:`read_block` of a compressed record: read block ``n``'s chunk, decompress it
        into ``buf`` (through a temporary buffer when ``buf`` is smaller), verify it."""
        from . import codec  # numpy and zstandard: only compressed records need them
        from .records import itemsize

        where, csize = r.chunks[n] if r.chunks else (0, 0)
        frame = self._buffer("frame", csize, codec.max_frame(self.block))
        if _pread_all(self.fd, frame, where) < csize:
            raise ShardError(self.rank, self.path, "unexpected end of file", tensor=r.name)
        item = itemsize(r.dtype)
        out = buf[:size] if len(buf) >= size else self._buffer("out", size, self.block)
        try:
            codec.decompress(r.codec or "", frame, out,
                             codec.chunk_elements(r.nbytes, item, self.block) * item, item)
        except ValueError as e:
            raise ShardError(self.rank, self.path, f"block {n} (compressed, bytes {where}.."
                             f"{where + csize}): {e}: the data is corrupt", tensor=r.name) from None
        if checksum.digest(out) != r.checksums[n]:
            raise ShardError(self.rank, self.path, f"checksum mismatch in block {n} (compressed, "
                             f"bytes {where}..{where + csize}): the data is corrupt",
                             tensor=r.name)
        return size


VERIFY_CHUNK = 8 << 20  # the most one verifying thread holds


def verify_file(rank: int, path: str, file_bytes: int, records: list[TensorRecord], block: int,
                threads: int = 4) -> None:
    """Read every checksum block of a shard and compare it (:class:`ShardError` for the first
    problem, by record and block; OSError-free: a file that cannot be opened is one too)."""
    try:
        f = BlockFile(rank, path, file_bytes, block)
    except OSError as e:
        raise ShardError(rank, path, f"cannot open: {e.strerror}") from None
    with f:
        check_records(rank, path, records, file_bytes, block)
        tasks = [(r, b) for r in records for b in range(checksum.block_count(r.nbytes, block))]
        local = threading.local()

        def check(task: tuple[TensorRecord, int]) -> ShardError | None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(min(VERIFY_CHUNK, block)))
            try:
                f.read_block(task[0], task[1], buf)
            except ShardError as e:
                return e
            return None

        with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="mpickpt-verify") as pool:
            for err in pool.map(check, tasks):
                if err is not None:
                    raise err
