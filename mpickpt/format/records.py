"""What a manifest says of one tensor, and the checks of those records against a shard file.

Torch-free (and numpy- and h5py-free, but for compressed records), so that the operator's tools
can read and check a checkpoint without importing either: the element types are known here by
name, with their size and the numpy type their HDF5 dataset is declared with
(:mod:`mpickpt.format.dtypes` maps them to torch).
:mod:`mpickpt.format.shard` re-exports everything here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ShardError
from . import checksum, rootdir

FORMAT = "mpickpt-shard"
VERSION = 1
TENSORS_GROUP = "tensors"


def rank_group(rank: int) -> str:
    """The HDF5 group of rank ``rank``'s datasets and attributes in a node's file."""
    return f"rank-{rank:05d}"

# name -> (bytes per element, numpy storage type). Types numpy knows are stored as themselves;
# the others (bfloat16, the float8 family, complex32) as unsigned integers of the same width.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "<f8"), "float32": (4, "<f4"), "float16": (2, "<f2"),
    "bfloat16": (2, "<u2"), "complex128": (16, "<c16"), "complex64": (8, "<c8"),
    "complex32": (4, "<u4"), "int64": (8, "<i8"), "int32": (4, "<i4"), "int16": (2, "<i2"),
    "int8": (1, "i1"), "uint64": (8, "<u8"), "uint32": (4, "<u4"), "uint16": (2, "<u2"),
    "uint8": (1, "u1"), "bool": (1, "?"), "float8_e4m3fn": (1, "u1"), "float8_e5m2": (1, "u1"),
    "float8_e4m3fnuz": (1, "u1"), "float8_e5m2fnuz": (1, "u1"), "float8_e8m0fnu": (1, "u1"),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a stored dtype name; KeyError for a name not in :data:`DTYPES`."""
    return DTYPES[dtype][0]


@dataclass
class TensorRecord:
    """Where one tensor lies in its shard, and the checksums of its blocks."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    checksums: list[str] = field(default_factory=list)
    # a piece of a sharded or replicated tensor: the whole tensor's shape and where this piece
    # (of shape ``shape``) begins in it; None for a rank's own tensor
    global_shape: list[int] | None = None
    offsets: list[int] | None = None
    # an incremental checkpoint's record of a tensor that had not changed: the shard of an older
    # checkpoint its bytes lie in (``step-XXXXXXXX/rank-XXXXX.h5`` or a node's file, in a
    # sibling of this checkpoint's directory), and ``offset`` is in that file; None: in this
    # rank's own shard
    source: str | None = None
    # a compressed tensor (:mod:`mpickpt.format.codec`): the codec, and where each checksum block's
    # chunk lies in the file, [byte offset, bytes]; ``offset`` is then unused (0)
    codec: str | None = None
    chunks: list[list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """As JSON values (what ``dataclasses.asdict`` gives, without its copies: the lists are
        shared, as a record's are not changed once it is complete; a copy of each per tensor
        and save was a third of the objects a save of many small tensors keeps for Python's
        collector to scan)."""
        d = {"name": self.name, "dtype": self.dtype, "shape": self.shape,
             "offset": self.offset, "nbytes": self.nbytes, "checksums": self.checksums,
             "global_shape": self.global_shape, "offsets": self.offsets}
        if self.source is not None:
            d["source"] = self.source
        if self.codec is not None:
            d["codec"] = self.codec
            d["chunks"] = [list(c) for c in self.chunks or ()]
        return d

    def extents(self) -> list[tuple[int, int]]:
        """The byte ranges (start, end) the record's data occupies in its file."""
        if self.codec is None:
            return [(self.offset, self.offset + self.nbytes)] if self.nbytes else []
        return [(o, o + n) for o, n in self.chunks or ()]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``lo`` up to ``hi`` (exclusive) of a stored record's data."""

    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def check_records(
    rank: int, path: str, records: list[TensorRecord], file_bytes: int, block: int
) -> None:
    """Refuse records that cannot describe a real file of ``file_bytes`` bytes: unknown dtypes,
    impossible shapes, sizes that do not match the shape, byte ranges outside the file or
    overlapping another record's, a name recorded twice."""
    total = 0
    names: set[str] = set()
    for r in records:
        def bad(reason: str, r: TensorRecord = r) -> ShardError:
            return ShardError(rank, path, reason, tensor=r.name)

        try:
            size = itemsize(r.dtype)
        except KeyError:
            raise bad(f"unknown dtype {r.dtype!r}") from None
        if any(d < 0 or d >= 1 << 63 for d in r.shape) or len(r.shape) > 64:
            raise bad(f"impossible shape {r.shape}")
        if r.name in names:
            raise bad("recorded twice")
        names.add(r.name)
        if r.nbytes != math.prod(r.shape) * size:
            raise bad(f"{r.nbytes} bytes recorded, but {r.dtype}{r.shape} needs "
                      f"{math.prod(r.shape) * size}")
        if r.codec is not None:
            _check_chunks(r, bad, block, size)
        for lo, hi in r.extents():
            if lo < 0 or hi > file_bytes:
                raise bad(f"bytes {lo}..{hi} lie outside the {file_bytes}-byte file")
            total += hi - lo
        if len(r.checksums) != checksum.block_count(r.nbytes, block):
            raise bad(f"{len(r.checksums)} checksums recorded for "
                      f"{checksum.block_count(r.nbytes, block)} blocks")
    if total > file_bytes:
        raise ShardError(rank, path, f"records claim {total} bytes, the file has {file_bytes}")
    end, last = 0, None
    for lo, hi, name in sorted((lo, hi, r.name) for r in records for lo, hi in r.extents()
                               if hi > lo):
        if lo < end:
            raise ShardError(rank, path, f"bytes {lo}..{hi} overlap those of tensor {last!r}",
                             tensor=name)
        end, last = hi, name


def _check_chunks(r: TensorRecord, bad: Any, block: int, itemsize: int) -> None:
    """A compressed record's codec and chunk list: one chunk per checksum block, each of a size
    a frame of its block can have."""
    from . import codec  # numpy: only compressed records need it

    if r.codec not in codec.CODECS:
        raise bad(f"unknown codec {r.codec!r}")
    if block % itemsize:
        raise bad(f"checksum block {block} is not a whole number of {r.dtype} elements")
    if r.nbytes == 0:
        raise bad("a compressed record of no bytes")
    chunk = codec.chunk_elements(r.nbytes, itemsize, block) * itemsize
    n = checksum.block_count(r.nbytes, block)
    if not isinstance(r.chunks, list) or len(r.chunks) != n:
        raise bad(f"{0 if r.chunks is None else len(r.chunks)} compressed chunks recorded for "
                  f"{n} blocks")
    for c in r.chunks:
        if not (isinstance(c, list) and len(c) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in c)) \
                or c[0] < 0 or not 0 < c[1] <= codec.max_frame(chunk):
            raise bad(f"compressed chunk {c!r} is not [offset, bytes] of a frame of a "
                      f"{chunk}-byte chunk")


def check_file(rank: int, path: str, file_bytes: int) -> None:
    """Refuse a shard that is not a regular file of exactly ``file_bytes`` bytes (a symbolic
    link, a FIFO, a truncated or replaced file) before anything is allocated for it."""
    try:
        os.close(open_shard(rank, path, file_bytes))
    except OSError as e:
        raise ShardError(rank, path, f"cannot open: {e.strerror}") from None


def open_shard(rank: int, path: str, file_bytes: int) -> int:
    """:func:`mpickpt.format.rootdir.open_regular`, and the size must be ``file_bytes``
    (:class:`ShardError` otherwise)."""
    fd = rootdir.open_regular(path)
    actual = os.fstat(fd).st_size
    if actual != file_bytes:
        os.close(fd)
        raise ShardError(rank, path, f"size is {actual} bytes, the manifest says {file_bytes} "
                         "(truncated or replaced)")
    return fd
