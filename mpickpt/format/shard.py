"""The shard file: one HDF5 file per rank, one contiguous aligned dataset per tensor.

h5py lays the file out (:mod:`mpickpt.format.h5layout`: datasets allocated early, never filled,
aligned to ``alignment`` bytes) and reports each dataset's byte offset; the tensor bytes are then
written with plain ``pwrite`` at those offsets by several threads, hashing each block on the way,
so HDF5 costs no bandwidth. A layout seen before costs no HDF5 call at all: its metadata is
written again with this save's values (:mod:`mpickpt.format.h5template`). The file stays an
ordinary HDF5 file: ``h5py``/``h5dump`` read it, with attributes ``torch_dtype``, ``shape`` and
``xxh3_64`` on each dataset and the JSON tree on the root.

Reading never goes through HDF5 (:mod:`mpickpt.format.reader`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from . import checksum, compressed, rootdir
from .blocks import _open_direct, _pwrite, pwrite_all
from .framesink import FrameSink
from .h5image import MetadataImage, padding, place
from .h5layout import Layout
from .h5template import MIN_TREE, Template
from .hostcopy import host_copy
from .iothreads import beside, run_tasks, start_tasks
from .records import (  # the torch-free half, re-exported: mpickpt.format.shard.TensorRecord etc.
    FORMAT as FORMAT,
)
from .records import TENSORS_GROUP as TENSORS_GROUP
from .records import VERSION as VERSION
from .records import TensorRecord
from .records import check_file as check_file  # re-exported too
from .records import check_records as check_records

DEFAULT_ALIGNMENT = 1 << 20
# a shard of at most this many bytes is written by the calling thread alone, through the page
# cache: handing its few blocks to the I/O threads costs more than it saves, and so does O_DIRECT
# (a 1.6 MB shard of 16 tensors: 4.3-5.0 ms of CPU per save with it, 3.2-3.7 ms without, the
# directory, the fsync and the removal of an older one included)
INLINE_BYTES = 4 << 20
# into a destination, a block is hashed and copied this many bytes at a time, so that the copy
# reads what the hash just read from the CPU's cache rather than from memory again
PIECE = 512 << 10
ZERO_PIECE = 1 << 20  # a destination's padding is zeroed this many bytes a write at most


def size_bound(nbytes: int, count: int, tree_bytes: int, *,
               alignment: int = DEFAULT_ALIGNMENT, block: int = checksum.DEFAULT_BLOCK) -> int:
    """At most the bytes of a raw shard of ``count`` tensors of ``nbytes`` in all, whose state
    tree is ``tree_bytes`` of JSON: the data; HDF5's own (6 kB), the tree attribute (padded to
    a power of two) and each dataset's header, attributes and checksums (about 400 bytes and
    its name, which the tree holds too: ``tests/test_shard_bound.py`` measures them); and the
    padding before each tensor of ``alignment`` bytes or more (a bound, not an estimate: a
    budget checked against it never overflows)."""
    aligned = min(count, nbytes // alignment)
    return (nbytes + (64 << 10) + 4 * tree_bytes + MIN_TREE + count * (1 << 10)
            + 8 * (nbytes // block + count) + aligned * alignment)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Views(Sequence[memoryview]):
    """Each record's bytes (:func:`byte_view`), made when asked for: a list of them, alive
    through the write, was four objects a tensor for Python's collector to scan."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], records: Sequence[TensorRecord]
                 ) -> None:
        self._tensors, self._records = tensors, records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]  # (no slices)
        return byte_view(self._tensors[self._records[i].name])


def _io_tasks(records: Iterable[TensorRecord], block: int) -> list[tuple[int, int]]:
    """(record index, block index) for every block of every record, largest tensors first."""
    order = sorted(enumerate(records), key=lambda r: -r[1].nbytes)
    return [(i, b) for i, r in order for b in range(checksum.block_count(r.nbytes, block))]


class Destination(Protocol):
    """Where a shard goes instead of a file of its own (the node-local level's recycled, mapped
    files): ``fd`` is open for reading and writing; ``reserve(n)`` grows the file to ``n``
    bytes at least and gives its first ``n`` as a writable ``uint8`` tensor."""

    fd: int

    def reserve(self, nbytes: int) -> torch.Tensor: ...


# one rank's part of a node's file: its HDF5 group, tensors and attributes
Part = tuple[str, Mapping[str, torch.Tensor], Mapping[str, str | int]]


class ShardWriter:
    """Create a shard's layout, fill it from host tensors, then seal it (checksums, fsync).

    The layout comes from ``template`` when one is given (:mod:`mpickpt.format.h5template`: the
    metadata is written at the seal, HDF5 does nothing); else HDF5 lays it out, in memory when
    the shard goes ``into`` a destination, in the file otherwise."""

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
        template: Template | None = None,
    ) -> None:
        self.path = path
        self._block = block
        self._dst: torch.Tensor | None = None
        self._into: Destination | None = None
        self.metadata: list[tuple[int, bytes]] = []  # into: the bytes the seal wrote, less data
        self._template = template if not codecs else None
        self._attrs = attrs
        # into: HDF5 lays the file out in memory, the data goes straight into the destination
        self._image = MetadataImage() if into is not None and self._template is None else None
        self._raw: io.RawIOBase | None = None
        self._layout: Layout | None = None
        self._fd = self._dfd = -1
        if into is None:
            # created here, so its mode is rootdir.file_mode's less the umask (HDF5: 0o666); a
            # template's layout is written over a file there (a recycled one: rootdir.take),
            # and the seal ends it at its size
            keep = os.O_TRUNC if self._template is None else 0
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | keep | os.O_NOFOLLOW,
                               rootdir.file_mode(path))
        try:
            if self._template is not None:
                self.records = self._template.fresh_records()
            else:
                # compressed: HDF5 writes through a FrameSink, which leaves each chunk's
                # bytes to this writer's threads (O_DIRECT, as a raw shard's tensors)
                self._raw = self._image or (FrameSink(self._fd) if codecs else None)
                self._layout = Layout(self._raw or path, alignment=alignment, codecs=codecs,
                                      block=block, where=path)
                self._layout.add(tensors, attrs)
                self.records = self._layout.records
            if into is not None:
                self._into = into
                self._fd = os.dup(into.fd)
                self._dst = into.reserve(self.data_end)
            elif sum(r.nbytes for r in self.records) > INLINE_BYTES or codecs:
                self._dfd = _open_direct(path, os.O_WRONLY)  # else: the page cache costs less
        except BaseException:
            self.close()
            raise

    @property
    def size_hint(self) -> int | None:
        """The file's size once sealed, where the layout fixes it before a byte is written (a
        template's); else None."""
        return self._template.size if self._template is not None else None

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
            assert w._layout is not None
            out = []
            for group, tensors, attrs in parts:
                start = len(w.records)
                w._layout.add(tensors, attrs, group)
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
        w.path, w._block, w.records = path, 0, records
        w._dst, w._raw, w._layout, w._image, w._template = None, None, None, None, None
        w._into = None
        w._fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            w._dfd = _open_direct(path, os.O_WRONLY)
        except BaseException:
            os.close(w._fd)
            raise
        return w

    def write(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        block: int = checksum.DEFAULT_BLOCK,
        threads: int = 4,
        on_block: Callable[[], None] | None = None,
        digests: Mapping[str, list[str]] | None = None,
        meanwhile: Callable[[], None] | None = None,
        gate: Callable[[int, int], None] | None = None,
    ) -> None:
        """Write every tensor's bytes at its offset and hash each block; ``tensors`` must be the
        contiguous CPU tensors named as in the layout. ``digests`` gives the block checksums of
        tensors already hashed (an incremental save's comparison): those are not hashed again.

        ``meanwhile`` runs on this thread while the I/O threads write, which then take the
        blocks in the order of their addresses, each once ``gate(start, end)`` (its bytes'
        addresses) returns: the tensors' bytes may still be landing (:mod:`mpickpt.save.landing`).
        """
        views = _Views(tensors, self.records)
        addrs = [tensors[r.name].data_ptr() for r in self.records]
        known = [digests is not None and r.name in digests for r in self.records]
        for r, k in zip(self.records, known, strict=True):
            r.checksums = (list(digests[r.name]) if k and digests is not None
                           else [""] * checksum.block_count(r.nbytes, block))

        def task(i: int, b: int) -> None:
            r, lo = self.records[i], b * block
            buf = views[i][lo : lo + block]
            if gate is not None:
                gate(addrs[i] + lo, addrs[i] + lo + len(buf))
            if self._dst is not None:  # hash and copy a piece at a time: read once, from cache
                hasher = None if known[i] else checksum.hasher()
                at, src = r.offset + lo, tensors[r.name].reshape(-1).view(torch.uint8)
                for p in range(0, len(buf), PIECE):
                    n = min(PIECE, len(buf) - p)
                    if hasher is not None:
                        hasher.update(buf[p : p + n])
                    host_copy(self._dst[at + p : at + p + n], src[lo + p : lo + p + n])
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
        tasks = [(index[id(plain[i])], b) for i, b in _io_tasks(plain, block)]
        workers = 1 if small else threads
        compressed = any(r.codec is not None for r in self.records)
        if meanwhile is not None and workers <= 1:
            meanwhile()  # all of it first: nothing writes beside it
            meanwhile = gate = None
        if compressed and meanwhile is not None:
            # each block compressed once landed (not all landed first: docs/performance.md),
            # then the few small raw tensors
            beside(meanwhile, lambda: (
                self._write_compressed(views, block, threads, on_block, known, gate, addrs),
                run_tasks(tasks, task, workers, background=True)))
            return
        if meanwhile is None:
            run_tasks(tasks, task, workers, background=True)
        else:
            tasks.sort(key=lambda t: addrs[t[0]] + t[1] * block)
            batch = start_tasks(tasks, task, workers, background=True)
            try:
                meanwhile()
            except BaseException:
                batch.abandon()
                raise
            batch.wait()
        if compressed:
            self._write_compressed(views, block, threads, on_block, known)

    def _write_compressed(self, views: _Views, block: int, threads: int,
                          on_block: Callable[[], None] | None, known: list[bool],
                          gate: Callable[[int, int], None] | None = None,
                          addrs: list[int] | None = None) -> None:
        """The compressed records' blocks (:func:`mpickpt.format.compressed.write`)."""
        if block != self._block:
            raise ValueError(f"the layout has {self._block}-byte chunks, not {block}")
        assert self._layout is not None
        sink = self._raw if isinstance(self._raw, FrameSink) else None
        compressed.write(self.records, self._layout.datasets, sink, (self._fd, self._dfd),
                         views, block, threads, on_block, known, gate, addrs)

    def seal(self) -> int:
        """Record checksums as attributes, the metadata written, fsync; the file's size."""
        try:
            self._dst = None
            if self._template is not None:  # the layout's metadata with this save's values
                t, a = self._template, self._attrs
                self.metadata = t.render(int(a["step"]), str(a["tree"]),
                                         [r.checksums for r in self.records])
                self._zero_padding(t.size)
                place(self._fd, self.metadata, t.size)
            else:
                assert self._layout is not None, "a region is sealed by its file's owner"
                self._layout.seal()
                if self._image is not None:  # HDF5's bytes into the destination
                    self.metadata = list(self._image.extents(self.data_ranges()))
                    self._zero_padding(self._image.size)
                    place(self._fd, self.metadata, self._image.size)
            os.fsync(self._fd)
            return os.fstat(self._fd).st_size
        finally:
            self.close()

    def _zero_padding(self, size: int) -> None:
        """A destination's bytes below ``size`` that neither a tensor nor HDF5 writes (alignment
        padding: a recycled file's old bytes) made zeros, so that the file holds the bytes a
        fresh one would (the node-local level's XOR parity is made from the tensors and the
        metadata alone, and rebuilt from the files). Padding is less than the alignment per
        tensor: a few MB for gigabytes of large tensors."""
        if self._into is None:
            return
        gaps = padding(size, [*self.data_ranges(), *((o, len(b)) for o, b in self.metadata)])
        zeros = memoryview(bytes(min(ZERO_PIECE, max((n for _, n in gaps), default=0))))
        for off, n in gaps:
            for at in range(off, off + n, ZERO_PIECE):
                pwrite_all(self._fd, zeros[:min(ZERO_PIECE, off + n - at)], at)

    def close(self) -> None:
        """Release the file without sealing it (after an error). Its descriptors are closed even
        when HDF5 cannot flush (a full disk), and HDF5's error does not hide the first one."""
        try:
            self._dst = None
            if self._layout is not None:
                self._layout.close()
        finally:
            for fd in (self._fd, self._dfd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._dfd = -1
            if self._raw is not None:
                self._raw.close()
