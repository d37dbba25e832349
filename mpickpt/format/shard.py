"""The shard file: one HDF5 file per rank, one contiguous aligned dataset per tensor.

h5py lays the file out (datasets allocated early, never filled, aligned to ``alignment`` bytes) and
reports each dataset's byte offset; the tensor bytes are then written with plain ``pwrite`` at those
offsets by several threads, hashing each block on the way, so HDF5 costs no bandwidth. The file
stays an ordinary HDF5 file: ``h5py``/``h5dump`` read it, with attributes ``torch_dtype``, ``shape``
and ``xxh3_64`` on each dataset and the JSON tree on the root.

Reading never goes through HDF5 (:mod:`mpickpt.format.reader`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import h5py
import numpy as np
import torch

from . import checksum, dtypes, rootdir
from .blocks import DIRECT_ALIGN, _direct_len, _open_direct, pwrite_all
from .h5image import MetadataImage, place
from .iothreads import pool, run_tasks
from .records import (  # the torch-free half, re-exported: mpickpt.format.shard.TensorRecord etc.
    FORMAT,
    TENSORS_GROUP,
    VERSION,
    TensorRecord,
)
from .records import check_file as check_file  # re-exported too
from .records import check_records as check_records

DEFAULT_ALIGNMENT = 1 << 20
# a shard of at most this many bytes is written by the calling thread alone: handing its few
# blocks to the I/O threads costs more than it saves
INLINE_BYTES = 4 << 20
# into a destination, a block is hashed and copied this many bytes at a time, so that the copy
# reads what the hash just read from the CPU's cache rather than from memory again
PIECE = 512 << 10


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _dataset_path(name: str) -> str:
    return f"{TENSORS_GROUP}/{name}"


def _io_tasks(records: Iterable[TensorRecord], block: int) -> list[tuple[int, int]]:
    """(record index, block index) for every block of every record, largest tensors first."""
    order = sorted(enumerate(records), key=lambda r: -r[1].nbytes)
    return [(i, b) for i, r in order for b in range(checksum.block_count(r.nbytes, block))]


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


def _set_attr(obj: h5py.h5o.ObjectID, name: str, value: str | int | np.ndarray) -> None:
    """A new attribute, as ``obj.attrs[name] = value`` makes it (a str as a variable-length
    UTF-8 string, an int as int64), through the low-level API: 3x faster, which counts for
    small checkpoints taken every step."""
    arr = np.array(value, dtype=h5py.string_dtype()) if isinstance(value, str) else \
        np.asarray(value)
    tid = h5py.h5t.py_create(arr.dtype, logical=True)
    space = (h5py.h5s.create(h5py.h5s.SCALAR) if arr.shape == ()
             else h5py.h5s.create_simple(arr.shape))
    h5py.h5a.create(obj, name.encode(), tid, space).write(arr)


class Destination(Protocol):
    """Where a shard goes instead of a file of its own (the node-local level's recycled, mapped
    files): ``fd`` is open for reading and writing; ``reserve(n)`` grows the file to ``n``
    bytes at least and gives its first ``n`` as a writable ``uint8`` tensor."""

    fd: int

    def reserve(self, nbytes: int) -> torch.Tensor: ...


# one rank's part of a node's file: its HDF5 group, tensors and attributes
Part = tuple[str, Mapping[str, torch.Tensor], Mapping[str, str | int]]


class ShardWriter:
    """Create a shard's layout, fill it from host tensors, then seal it (checksums, fsync)."""

    def __init__(
        self,
        path: str,
        tensors: Mapping[str, torch.Tensor],
        attrs: Mapping[str, str | int],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        into: Destination | None = None,
        codecs: Mapping[str, str] | None = None,
        block: int = checksum.DEFAULT_BLOCK,
    ) -> None:
        self.path = path
        self._codecs = dict(codecs or {})  # tensor name -> codec: compressed (mpickpt.format.codec)
        self._block = block
        self.records: list[TensorRecord] = []
        self._datasets: list[h5py.h5d.DatasetID] = []  # of the records, for their checksums
        self._dst: torch.Tensor | None = None
        self.metadata: list[tuple[int, bytes]] = []  # into: the bytes the seal wrote, less data
        # into: HDF5 lays the file out in memory, the data goes straight into the destination
        self._image = MetadataImage() if into is not None else None
        if into is None:
            # created here, so its mode is rootdir.file_mode's less the umask (HDF5: 0o666)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                             rootdir.file_mode(path)))
        # HDF5 writes through a Python file object when chunks are compressed: its writes
        # (the frames) then release the GIL, which HDF5's own driver holds while it writes
        self._raw = self._image or (io.FileIO(path, "r+") if self._codecs else None)
        self._h5 = h5py.File(
            self._raw or path, "w", libver=("v108", "v110"),
            alignment_threshold=alignment, alignment_interval=alignment,
        )
        try:
            _set_attr(self._h5.id, "mpickpt_format", FORMAT)
            _set_attr(self._h5.id, "mpickpt_version", VERSION)
            self._layout(tensors, attrs)
            if into is not None:
                self._fd, self._dfd = os.dup(into.fd), -1
                self._dst = into.reserve(self.data_end)
            else:
                self._fd = os.open(path, os.O_WRONLY)
                self._dfd = _open_direct(path, os.O_WRONLY)
        except BaseException:
            self.close()
            raise

    @property
    def data_end(self) -> int:
        """Where the last tensor's bytes end in the file (its metadata may follow)."""
        return max((r.offset + r.nbytes for r in self.records if r.codec is None), default=0)

    def data_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of every tensor's bytes that :meth:`write` puts in place."""
        return [(r.offset, r.nbytes) for r in self.records if r.codec is None and r.nbytes]

    @classmethod
    def node_file(cls, path: str, parts: Sequence[Part], *, alignment: int = DEFAULT_ALIGNMENT
                  ) -> tuple[ShardWriter, list[list[TensorRecord]]]:
        """The layout of a node's file: each part (HDF5 group, tensors, attributes: one rank's)
        laid out in its group, every dataset aligned. Returns the writer, which only seals
        (the ranks write through :meth:`region`), and each part's records. The tensors may be on
        the ``meta`` device: only their dtypes and shapes are used."""
        w = cls(path, {}, {}, alignment=alignment)
        try:
            out = []
            for group, tensors, attrs in parts:
                start = len(w.records)
                w._layout(tensors, attrs, group)
                out.append(w.records[start:])
        except BaseException:
            w.close()
            raise
        return w, out

    @classmethod
    def region(cls, path: str, records: list[TensorRecord]) -> ShardWriter:
        """A writer of ``records`` into the file ``path`` that another process laid out (a
        node's file): :meth:`write` fills them; :meth:`close` releases it (the file's owner
        seals it)."""
        w = cls.__new__(cls)
        w.path, w._codecs, w._block, w.records = path, {}, 0, records
        w._datasets, w._dst, w._raw, w._h5, w._image = [], None, None, None, None
        w._fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            w._dfd = _open_direct(path, os.O_WRONLY)
        except BaseException:
            os.close(w._fd)
            raise
        return w

    def _layout(self, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str | int],
                group: str | None = None) -> None:
        f = self._h5
        where = f.id if group is None else h5py.h5g.create(f.id, group.encode())
        prefix = "" if group is None else f"{group}/"
        for k, v in attrs.items():
            _set_attr(where, k, v)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        for name, t in tensors.items():
            dname = dtypes.name_of(t.dtype)
            shape = tuple(t.shape)
            nbytes = t.numel() * t.element_size()
            tid = h5py.h5t.py_create(dtypes.storage_dtype(dname))
            c = self._codecs.get(name) if nbytes else None
            if c is not None:  # one-dimensional, chunked: one chunk per checksum block
                ds = self._compressed_dataset(prefix + _dataset_path(name), tid, t, c, lcpl)
                offset = 0
            else:
                space = (h5py.h5s.create_simple(shape) if shape
                         else h5py.h5s.create(h5py.h5s.SCALAR))
                ds = h5py.h5d.create(
                    f.id, (prefix + _dataset_path(name)).encode(), tid, space, dcpl=dcpl,
                    lcpl=lcpl)
                offset = ds.get_offset() if nbytes else 0
                if offset is None:
                    raise OSError(f"{self.path}: HDF5 gave no offset for dataset {name!r}")
            self._datasets.append(ds)
            _set_attr(ds, "torch_dtype", dname)
            _set_attr(ds, "shape", np.asarray(shape, dtype=np.int64))
            self.records.append(TensorRecord(name, dname, list(shape), int(offset), nbytes,
                                             codec=c))

    def _compressed_dataset(self, path: str, tid: h5py.h5t.TypeID, t: torch.Tensor, c: str,
                            lcpl: h5py.h5p.PropLCID) -> h5py.h5d.DatasetID:
        """A chunked dataset with the filters that read what :func:`mpickpt.format.codec.compress`
        makes (HDF5 runs none of them here: the chunks are written directly)."""
        from . import codec

        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((codec.chunk_elements(t.numel() * t.element_size(), t.element_size(),
                                             self._block),))
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        if c == "zstd+shuffle":
            dcpl.set_shuffle()
        dcpl.set_filter(codec.ZSTD_FILTER, h5py.h5z.FLAG_OPTIONAL, (codec.LEVEL,))
        space = h5py.h5s.create_simple((t.numel(),))
        return h5py.h5d.create(self._h5.id, path.encode(), tid, space, dcpl=dcpl,
                               lcpl=lcpl)

    def write(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        block: int = checksum.DEFAULT_BLOCK,
        threads: int = 4,
        on_block: Callable[[], None] | None = None,
        digests: Mapping[str, list[str]] | None = None,
    ) -> None:
        """Write every tensor's bytes at its offset and hash each block; ``tensors`` must be the
        contiguous CPU tensors named as in the layout. ``digests`` gives the block checksums of
        tensors already hashed (an incremental save's comparison): those are not hashed again."""
        views = [byte_view(tensors[r.name]) for r in self.records]
        addrs = [tensors[r.name].data_ptr() for r in self.records]
        known = [digests is not None and r.name in digests for r in self.records]
        for r, k in zip(self.records, known, strict=True):
            r.checksums = (list(digests[r.name]) if k and digests is not None
                           else [""] * checksum.block_count(r.nbytes, block))

        sources = ([tensors[r.name].reshape(-1).view(torch.uint8) for r in self.records]
                   if self._dst is not None else [])

        def task(i: int, b: int) -> None:
            r, lo = self.records[i], b * block
            buf = views[i][lo : lo + block]
            if self._dst is not None:  # hash and copy a piece at a time: read once, from cache
                hasher = None if known[i] else checksum.hasher()
                at, src = r.offset + lo, sources[i]
                for p in range(0, len(buf), PIECE):
                    n = min(PIECE, len(buf) - p)
                    if hasher is not None:
                        hasher.update(buf[p : p + n])
                    self._dst[at + p : at + p + n].copy_(src[lo + p : lo + p + n])
                if hasher is not None:
                    r.checksums[b] = hasher.hexdigest()
            else:
                if not known[i]:
                    r.checksums[b] = checksum.digest(buf)
                _pwrite(self._fd, self._dfd, addrs[i] + lo, buf, r.offset + lo)
            if on_block is not None:
                on_block()

        small = sum(r.nbytes for r in self.records) <= INLINE_BYTES
        plain = [r for r in self.records if r.codec is None]
        index = {id(r): i for i, r in enumerate(self.records)}
        run_tasks([(index[id(plain[i])], b) for i, b in _io_tasks(plain, block)], task,
             1 if small else threads, background=True)
        if any(r.codec is not None for r in self.records):
            self._write_compressed(views, block, threads, on_block, known)

    def _write_compressed(self, views: list[memoryview], block: int, threads: int,
                          on_block: Callable[[], None] | None, known: list[bool]) -> None:
        """Compress every block of the compressed records on ``threads`` threads (hashing the
        raw bytes first, unless known) and hand the chunks to HDF5 in order, a few ahead."""
        from . import codec

        if block != self._block:
            raise ValueError(f"the layout has {self._block}-byte chunks, not {block}")
        jobs = [(i, b) for i, r in enumerate(self.records) if r.codec is not None
                for b in range(checksum.block_count(r.nbytes, block))]
        sizes = {i: (dtypes.itemsize(r.dtype),
                     codec.chunk_elements(r.nbytes, dtypes.itemsize(r.dtype), block))
                 for i, r in enumerate(self.records) if r.codec is not None}

        def compress(i: int, b: int) -> tuple[str | None, bytes]:
            r, raw = self.records[i], views[i][b * block: (b + 1) * block]
            item, elems = sizes[i]
            digest = None if known[i] else checksum.digest(raw)
            return digest, codec.compress(r.codec or "", raw, elems * item, item)

        workers = pool(threads, True) if threads > 1 else None
        ahead = max(2 * threads, 2)
        pending = [workers.submit(compress, *j) if workers else None for j in jobs[:ahead]]
        try:
            for k, (i, b) in enumerate(jobs):
                fut = pending[k]
                digest, frame = fut.result() if fut else compress(i, b)
                if workers and k + ahead < len(jobs):
                    pending.append(workers.submit(compress, *jobs[k + ahead]))
                r = self.records[i]
                if digest is not None:
                    r.checksums[b] = digest
                self._datasets[i].write_direct_chunk((b * sizes[i][1],), frame)
                if on_block is not None:
                    on_block()
        except BaseException:
            for fut in pending:
                if fut is not None:
                    fut.cancel()
            raise
        for i, r in enumerate(self.records):
            if r.codec is not None:
                ds, elems = self._datasets[i], sizes[i][1]
                infos = [ds.get_chunk_info_by_coord((b * elems,))
                         for b in range(checksum.block_count(r.nbytes, block))]
                r.chunks = [[int(x.byte_offset), int(x.size)] for x in infos]

    def seal(self) -> int:
        """Record checksums as attributes, close HDF5, fsync; return the file's size in bytes."""
        try:
            self._dst = None
            for r, ds in zip(self.records, self._datasets, strict=True):
                _set_attr(ds, "xxh3_64", ",".join(r.checksums))
            assert self._h5 is not None, "a region is sealed by its file's owner"
            self._h5.close()
            if self._image is not None:  # HDF5's bytes into the destination, around the data
                self.metadata = list(self._image.extents(self.data_ranges()))
                place(self._fd, self.metadata, self._image.size)
            os.fsync(self._fd)
            return os.fstat(self._fd).st_size
        finally:
            self.close()

    def close(self) -> None:
        """Release the file without sealing it (after an error). Its descriptors are closed even
        when HDF5 cannot flush (a full disk), and HDF5's error does not hide the first one."""
        self._datasets = []
        try:
            self._dst = None
            if self._h5 is not None and self._h5.id.valid:
                self._h5.close()
        except Exception:
            pass  # the file is discarded: its metadata need not reach the disk
        finally:
            for fd in (getattr(self, "_fd", -1), getattr(self, "_dfd", -1)):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._dfd = -1
            if getattr(self, "_raw", None) is not None:
                self._raw.close()
