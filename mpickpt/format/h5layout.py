"""HDF5's part of a shard: its file (on disk, or a file object), the datasets laid out and their
attributes, through h5py's low-level API. No tensor byte goes through HDF5: datasets are
contiguous, allocated early and never filled, aligned, and their offsets are what the writers
``pwrite`` at (:mod:`mpickpt.format.shard`).

A layout made in memory takes HDF5's earliest format: superblock 0, version-1 object headers,
symbol-table groups, none of which carries a checksum, so that the bytes of an attribute's value
stand as they are in the file and a layout made once can be written again with other values
(:mod:`mpickpt.format.h5template`); its writer writes it last, when it seals the shard. A file
HDF5 writes itself (compressed chunks, a node's file) keeps the format of 1.8 and later
(superblock 2), whose superblock says whether the file is still open for writing, as a writer
killed in the middle leaves it (``mpickpt ls`` tells it). Every HDF5 reader, h5py and h5dump
included, reads both.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping

import h5py
import numpy as np
import torch

from . import checksum, dtypes
from .records import FORMAT, TENSORS_GROUP, VERSION, TensorRecord

EARLIEST = ("earliest", "v110")  # in memory (a template, a write into a destination)
ON_DISK = ("v108", "v110")  # HDF5 writing the file itself


def dataset_path(name: str) -> str:
    return f"{TENSORS_GROUP}/{name}"


def let_others_run() -> None:
    """Between two calls into h5py on a save's background thread: h5py holds the GIL through
    each (HDF5 writing its metadata through Python's file object), so give a waiting thread,
    the training loop's, its turn now rather than at the interpreter's next switch (5 ms)."""
    os.sched_yield()


_STR = np.dtype(h5py.string_dtype())  # variable-length UTF-8, as h5py writes a str
_STR_TYPE = h5py.h5t.py_create(_STR, logical=True)  # (made once: most attributes are str)


def set_attr(obj: h5py.h5o.ObjectID, name: str, value: str | int | np.ndarray) -> None:
    """A new attribute, as ``obj.attrs[name] = value`` makes it (a str as a variable-length
    UTF-8 string, an int as int64), through the low-level API: 3x faster, which counts for
    small checkpoints taken every step."""
    if isinstance(value, str):
        arr, tid = np.array(value, dtype=_STR), _STR_TYPE
    else:
        arr = np.asarray(value)
        tid = h5py.h5t.py_create(arr.dtype, logical=True)
    space = (h5py.h5s.create(h5py.h5s.SCALAR) if arr.shape == ()
             else h5py.h5s.create_simple(arr.shape))
    h5py.h5a.create(obj, name.encode(), tid, space).write(arr)


class Layout:
    """A shard's HDF5 file being laid out on ``target`` (a path, or a file object such as
    :class:`~mpickpt.format.h5image.MetadataImage`): :meth:`add` lays out tensors and
    attributes, :meth:`seal` records the checksums and closes HDF5. ``codecs`` (tensor name ->
    codec) makes a tensor's dataset chunked, one chunk per ``block`` bytes (compressed)."""

    def __init__(self, target: str | io.RawIOBase, *, alignment: int,
                 codecs: Mapping[str, str] | None = None,
                 block: int = checksum.DEFAULT_BLOCK, where: str = "") -> None:
        self.codecs, self.block, self.where = dict(codecs or {}), block, where or str(target)
        self.records: list[TensorRecord] = []
        self.datasets: list[h5py.h5d.DatasetID] = []  # of the records, for their checksums
        libver = ON_DISK if isinstance(target, str) or codecs else EARLIEST
        self.h5 = h5py.File(target, "w", libver=libver, alignment_threshold=alignment,
                            alignment_interval=alignment)
        try:
            set_attr(self.h5.id, "mpickpt_format", FORMAT)
            set_attr(self.h5.id, "mpickpt_version", VERSION)
        except BaseException:
            self.h5.close()
            raise

    def add(self, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str | int],
            group: str | None = None) -> None:
        """Lay out ``tensors`` (only their dtypes and shapes count: they may be on the ``meta``
        device) and ``attrs``, in HDF5 group ``group`` or the root."""
        f = self.h5
        where = f.id if group is None else h5py.h5g.create(f.id, group.encode())
        prefix = "" if group is None else f"{group}/"
        for k, v in attrs.items():
            set_attr(where, k, v)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # the same layout makes the same bytes
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        for name, t in tensors.items():
            dname = dtypes.name_of(t.dtype)
            shape = tuple(t.shape)
            nbytes = t.numel() * t.element_size()
            tid = h5py.h5t.py_create(dtypes.storage_dtype(dname))
            c = self.codecs.get(name) if nbytes else None
            if c is not None:  # one-dimensional, chunked: one chunk per checksum block
                ds = self._compressed_dataset(prefix + dataset_path(name), tid, t, c, lcpl)
                offset = 0
            else:
                space = (h5py.h5s.create_simple(shape) if shape
                         else h5py.h5s.create(h5py.h5s.SCALAR))
                ds = h5py.h5d.create(
                    f.id, (prefix + dataset_path(name)).encode(), tid, space, dcpl=dcpl,
                    lcpl=lcpl)
                offset = ds.get_offset() if nbytes else 0
                if offset is None:
                    raise OSError(f"{self.where}: HDF5 gave no offset for dataset {name!r}")
            self.datasets.append(ds)
            set_attr(ds, "torch_dtype", dname)
            set_attr(ds, "shape", np.asarray(shape, dtype=np.int64))
            self.records.append(TensorRecord(name, dname, list(shape), int(offset), nbytes,
                                             codec=c))
            let_others_run()

    def _compressed_dataset(self, path: str, tid: h5py.h5t.TypeID, t: torch.Tensor, c: str,
                            lcpl: h5py.h5p.PropLCID) -> h5py.h5d.DatasetID:
        """A chunked dataset with the filters that read what :func:`mpickpt.format.codec.compress`
        makes (HDF5 runs none of them here: the chunks are written directly)."""
        from . import codec

        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((codec.chunk_elements(t.numel() * t.element_size(), t.element_size(),
                                             self.block),))
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)
        if c == "zstd+shuffle":
            dcpl.set_shuffle()
        dcpl.set_filter(codec.ZSTD_FILTER, h5py.h5z.FLAG_OPTIONAL, (codec.LEVEL,))
        space = h5py.h5s.create_simple((t.numel(),))
        return h5py.h5d.create(self.h5.id, path.encode(), tid, space, dcpl=dcpl, lcpl=lcpl)

    def seal(self) -> None:
        """Each record's checksums as its dataset's ``xxh3_64`` attribute; HDF5 closed (its
        metadata written to the target)."""
        for r, ds in zip(self.records, self.datasets, strict=True):
            set_attr(ds, "xxh3_64", ",".join(r.checksums))
            let_others_run()
        self.datasets = []
        self.h5.close()

    def close(self) -> None:
        """Let go of HDF5 without sealing (after an error: the file is discarded, so its
        metadata need not reach it, and HDF5's own error must not hide the first one)."""
        self.datasets = []
        try:
            if self.h5.id.valid:
                self.h5.close()
        except Exception:
            pass  # the file is discarded: its metadata need not reach the disk
