"""Reading a shard: never through HDF5. The manifest's records (offset, size, checksums) drive
positional reads, checked against the real file size first, so a hostile file cannot make the
reader allocate more than it holds. Each checksum block is read and verified straight into its
place in the tensor by :class:`mpickpt.format.blocks.BlockFile`, the reader the operator's tools
share, but for small tensors' blocks, read a run of them at a time and verified in memory
before they are copied into place; a whole shard (:func:`read_shard`) or byte spans of its
tensors (:func:`read_spans`, for resharding) on a few threads.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ..errors import ShardError
from . import checksum, dtypes, pages
from .blocks import RUN_BYTES, BlockFile, align
from .iothreads import Batch, run_tasks, start_tasks
from .records import TensorRecord, check_file, check_records, open_shard
from .shard import byte_view


def read_shard(
    rank: int,
    path: str,
    records: list[TensorRecord],
    file_bytes: int,
    *,
    block: int = checksum.DEFAULT_BLOCK,
    threads: int = 4,
    buffer: Callable[[int], torch.Tensor] | None = None,
    on_block: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read and verify every tensor of a shard into CPU tensors; raise :class:`ShardError`
    naming the file and tensor at the first size or checksum mismatch.

    ``buffer(nbytes)``, when given, supplies one (pinned, reusable) host buffer that the tensors
    are laid out in, page-aligned; otherwise each tensor is a new allocation."""
    check_records(rank, path, records, file_bytes, block)
    check_file(rank, path, file_bytes)
    if buffer is None:
        out = {r.name: torch.empty(r.shape, dtype=dtypes.torch_dtype(r.dtype)) for r in records}
    else:
        offsets, pos = [], 0
        for r in records:
            offsets.append(pos)
            pos = align(pos + r.nbytes)
        buf = buffer(pos)
        out = {r.name: buf[o : o + r.nbytes].view(dtypes.torch_dtype(r.dtype)).view(r.shape)
               for r, o in zip(records, offsets, strict=True)}
    spans = [Span(r, 0, r.nbytes, out[r.name].reshape(-1).view(torch.uint8)) for r in records]
    read_spans(rank, path, file_bytes, spans, block=block, threads=threads, on_block=on_block)
    return out


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``lo`` up to ``hi`` of stored record ``record``, to be read into ``dest`` (a
    contiguous uint8 CPU tensor of ``hi - lo`` elements)."""

    record: TensorRecord
    lo: int
    hi: int
    dest: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def read_spans(
    rank: int,
    path: str,
    file_bytes: int,
    spans: list[Span],
    *,
    block: int = checksum.DEFAULT_BLOCK,
    threads: int = 4,
    on_block: Callable[[], None] | None = None,
    bounce: Callable[[], AbstractContextManager[torch.Tensor]] | None = None,
) -> None:
    """Read bytes ``lo..hi`` of each span's record (``lo`` on a checksum block boundary, ``hi``
    on one or at the record's end) into its ``dest``, verifying every block
    (:meth:`mpickpt.format.blocks.BlockFile.read_block`, straight into place; spans of
    :data:`SMALL_SPAN` bytes or fewer in host memory a run at a time, :func:`_runs`);
    :class:`ShardError` naming the file, tensor and block at the first mismatch. A ``dest``
    in GPU memory takes each block, once verified, from ``with bounce() as buf``: a
    page-locked host buffer of at least a block, the block's while it is read and copied.

    The file is opened without following symbolic links and must be exactly ``file_bytes`` long;
    the records must have passed :func:`check_records`."""
    try:
        f = BlockFile(rank, path, file_bytes, block, direct=True)
    except OSError as e:
        raise ShardError(rank, path, f"cannot open: {e.strerror}") from None
    with f:
        for s in spans:
            if not _whole_blocks(s.record, s.lo, s.hi, block) or s.dest.numel() != s.nbytes:
                raise ValueError(f"span {s.lo}..{s.hi} of {s.record.name!r} is not whole "
                                 "checksum blocks")
        host = [s.dest.device.type == "cpu" for s in spans]
        if bounce is None and not all(host):
            raise ValueError("spans into GPU memory need a page-locked buffer to come through")
        small = [i for i, s in enumerate(spans)
                 if host[i] and s.record.codec is None and s.nbytes <= SMALL_SPAN]
        runs = _runs(spans, small)
        alone = set(range(len(spans))).difference(small)
        largest_first = sorted(alone, key=lambda i: -spans[i].nbytes)
        tasks = [(i, b) for i in largest_first
                 for b in range(checksum.block_count(spans[i].nbytes, block))]
        tasks += [(k, RUN) for k in range(len(runs))]

        def read_run(k: int) -> None:
            first, end, members = runs[k]
            data = f.read_run(first, end, spans[members[0]].record.name)
            for i in members:
                s = spans[i]
                view, start = byte_view(s.dest), s.record.offset + s.lo - first
                for at in range(0, max(s.nbytes, 1), block):  # (an empty record: one block)
                    piece = data[start + at:start + min(at + block, s.nbytes)]
                    f.check_block(s.record, (s.lo + at) // block, piece)
                    view[at:at + len(piece)] = piece
                    if on_block is not None:
                        on_block()

        def task(i: int, b: int) -> None:
            if b == RUN:
                read_run(i)
                return
            s, at = spans[i], b * block
            if host[i]:
                f.read_block(s.record, (s.lo + at) // block, byte_view(s.dest)[at : at + block])
            else:  # verified in the page-locked buffer, then copied (and waited for)
                assert bounce is not None
                with bounce() as buf:
                    n = f.read_block(s.record, (s.lo + at) // block, byte_view(buf)[:block])
                    s.dest[at : at + n].copy_(buf[:n])
            if on_block is not None:
                on_block()

        run_tasks(tasks, task, threads)


SMALL_SPAN = 64 << 10  # spans of this many bytes or fewer are read in runs (_runs)
RUN = -1  # a task's block number that makes it a run's (read_spans)
GAP = 64 << 10  # the most bytes between two spans of one run


def _runs(spans: list[Span], small: list[int]) -> list[tuple[int, int, list[int]]]:
    """The ``small`` spans (indices) by where their bytes lie in the file, in runs: (first
    byte, end, the spans in it), each run at most RUN_BYTES and without a gap of more than GAP
    bytes. One read of a run and a check of each block in memory replace a read per block:
    8,000 spans of a kilobyte took 0.37 s to read one by one on this project's VM."""
    out: list[tuple[int, int, list[int]]] = []
    for i in sorted(small, key=lambda i: spans[i].record.offset + spans[i].lo):
        lo = spans[i].record.offset + spans[i].lo
        hi = lo + spans[i].nbytes
        if out and lo >= out[-1][1] and lo - out[-1][1] <= GAP and hi - out[-1][0] <= RUN_BYTES:
            out[-1][2].append(i)
            out[-1] = (out[-1][0], hi, out[-1][2])
        else:
            out.append((lo, hi, [i]))
    return out


POPULATE_PIECE = 8 << 20


class MappedSpans:
    """Bytes ``lo..hi`` of each ``(record, lo, hi)`` (whole checksum blocks of uncompressed
    records, as :func:`read_spans` takes them) as read-only ``views`` of the file mapped into
    memory: nothing is copied. Nothing is verified until :meth:`verify` (a node's own shard in
    memory, used where it lies); bytes served to another rank are verified where they land,
    by :func:`verify_spans`. The views keep the map; it goes with the last of them."""

    def __init__(self, rank: int, path: str, file_bytes: int,
                 spans: list[tuple[TensorRecord, int, int]], *,
                 block: int = checksum.DEFAULT_BLOCK) -> None:
        try:
            fd = open_shard(rank, path, file_bytes)
        except OSError as e:
            raise ShardError(rank, path, f"cannot open: {e.strerror}") from None
        try:
            self._map = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ) \
                if file_bytes else None
        finally:
            os.close(fd)
        whole = memoryview(self._map) if self._map is not None else memoryview(b"")
        for r, lo, hi in spans:
            if r.codec is not None or not _whole_blocks(r, lo, hi, block):
                raise ValueError(f"span {lo}..{hi} of {r.name!r} is not whole checksum blocks "
                                 "of an uncompressed record")
        self.rank, self.path, self.block = rank, path, block
        self._spans = spans
        self.views = [whole[r.offset + lo:r.offset + hi] for r, lo, hi in spans]

    def populate(self, threads: int = 4) -> None:
        """Map the spans' pages in ahead of their use (``MADV_POPULATE_READ``, in pieces on
        ``threads``): bytes about to be sent, so that MPI's copy does not take a page fault at
        each page. Where the kernel cannot (before Linux 5.14), nothing happens."""
        if self._map is None:
            return
        page, step = mmap.PAGESIZE, POPULATE_PIECE
        tasks = [(a, min(a + step, end)) for r, lo, hi in self._spans if hi > lo
                 for start, end in [((r.offset + lo) // page * page, r.offset + hi)]
                 for a in range(start, end, step)]

        base = pages.address(self._map)  # (an older kernel: MPI takes the faults)
        run_tasks(tasks, lambda a, b: pages.populate(base, a, b - a), threads)

    def verify(self, threads: int = 4) -> None:
        """Every block of the spans checked where it lies; :class:`ShardError` naming the
        file, tensor and block at the first mismatch."""
        _verify_views(self.rank, self.path, [(r, lo, v) for (r, lo, _), v
                                             in zip(self._spans, self.views, strict=True)],
                      self.block, threads, "").wait()

    def close(self) -> None:
        """Let the map go, its pages first, piece by piece (:func:`pages.unmap`); where a view
        of it is still held elsewhere, it goes with the last one."""
        self.views = []
        if self._map is not None:
            with contextlib.suppress(BufferError):
                pages.unmap(self._map)
            self._map = None


def let_go_behind(held: list[object], maps: list[MappedSpans]) -> None:
    """Drop ``held``'s objects (views of ``maps``, and what else the caller holds no other
    reference to) and close ``maps``, on a thread of its own: unmapping GBs of pages mapped
    in takes tens of ms (about 90 for a 3 GB shard on an H200 host), which the other ranks,
    waiting at the next collective, would wait for too."""
    def run() -> None:
        held.clear()
        for m in maps:
            m.close()
        maps.clear()

    threading.Thread(target=run, daemon=True, name="mpickpt-unmap").start()


def verify_spans(rank: int, path: str, spans: list[Span], *,
                 block: int = checksum.DEFAULT_BLOCK, threads: int = 4, how: str = "") -> None:
    """Every block of each span's ``dest`` (bytes ``lo..hi`` of an uncompressed record of
    ``rank``'s shard, received rather than read: ``path`` is the file they came from) checked
    against the record's checksums; :class:`ShardError` naming the file, tensor and block
    (and ``how`` they came) at the first mismatch."""
    start_verify_spans(rank, path, spans, block=block, threads=threads, how=how).wait()


def start_verify_spans(rank: int, path: str, spans: list[Span], *,
                       block: int = checksum.DEFAULT_BLOCK, threads: int = 4, how: str = ""
                       ) -> Batch:
    """:func:`verify_spans` started on the I/O threads: its :meth:`Batch.wait` raises what
    :func:`verify_spans` would."""
    for s in spans:
        if s.record.codec is not None or not _whole_blocks(s.record, s.lo, s.hi, block):
            raise ValueError(f"span {s.lo}..{s.hi} of {s.record.name!r} is not whole checksum "
                             "blocks of an uncompressed record")
    return _verify_views(rank, path, [(s.record, s.lo, byte_view(s.dest)) for s in spans],
                         block, threads, how)


def _verify_views(rank: int, path: str, views: list[tuple[TensorRecord, int, memoryview]],
                  block: int, threads: int, how: str) -> Batch:
    """Each ``(record, lo, view)``: the view holds the record's bytes from ``lo`` (a block
    boundary) on; every block of it checked, on ``threads`` (started: wait for the batch)."""
    tasks = [(i, b) for i, (_, _, v) in enumerate(views) if len(v)
             for b in range(checksum.block_count(len(v), block))]

    def task(i: int, b: int) -> None:
        r, lo, v = views[i]
        n = lo // block + b
        got = v[b * block:(b + 1) * block]
        if checksum.digest(got) != r.checksums[n]:
            at = r.offset + n * block
            raise ShardError(rank, path, f"checksum mismatch in block {n} (bytes {at}.."
                             f"{at + len(got)}){how}: the data is corrupt", tensor=r.name)

    return start_tasks(tasks, task, threads)


def _whole_blocks(r: TensorRecord, lo: int, hi: int, block: int) -> bool:
    """Whether bytes ``lo..hi`` of record ``r`` are whole checksum blocks (``hi`` may be the
    record's end)."""
    return not lo % block and 0 <= lo <= hi <= r.nbytes and (not hi % block or hi == r.nbytes)
