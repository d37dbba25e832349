"""The HDF5 side of a shard, for full verification: can h5py read it, and does it say what the
manifest says?

Restore never parses HDF5: it reads the byte ranges the manifest lists and verifies their
checksums, so damage to a shard's HDF5 metadata (superblock, object headers, attributes) neither
stops a restore nor changes what it loads. It does make the file unreadable for every other tool
(h5py, h5dump, an export), so ``mpickpt verify`` (full) counts it as damage: the file must open,
its root attributes must name the format, this rank, this step and this world size and hold this
rank's state tree, and every tensor record must be a dataset of the recorded dtype, shape and
checksums starting at the recorded offset. The file is handed to h5py as the descriptor the
checks opened (never through a symbolic link). Only metadata is read, never tensor data. In a
node's file (``node-NNNNN.h5``) the rank's attributes and datasets are those of its group
``rank-RRRRR``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import h5py

from ..format.entry import RankEntry
from ..format.manifest import Manifest
from ..format.records import FORMAT, TENSORS_GROUP, TensorRecord, itemsize, rank_group


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _str(x: Any) -> str:
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


def problem(fd: int, m: Manifest, entry: RankEntry) -> str | None:
    """What is wrong with the HDF5 metadata of rank ``entry.rank``'s open shard, or None."""
    try:
        with os.fdopen(os.dup(fd), "rb") as raw, h5py.File(raw, "r") as f:
            why = _compare(f, m, entry)
    except Exception as e:  # h5py raises OSError, KeyError, ValueError, RuntimeError ...
        why = f"h5py cannot read it: {type(e).__name__}: {e}"
    if why is None:
        return None
    return (f"its HDF5 metadata is damaged or not this checkpoint's ({why}); restore reads the "
            "tensors without HDF5 and they verify, but h5py, h5dump and other tools see that")


def _compare(f: h5py.File, m: Manifest, entry: RankEntry) -> str | None:
    if _str(f.attrs.get("mpickpt_format")) != FORMAT:
        return f"its attributes do not name the {FORMAT!r} format"
    g: h5py.Group = f
    if os.path.basename(entry.file).startswith("node-"):  # a node's file: the rank's group
        group = f.get(rank_group(entry.rank))
        if not isinstance(group, h5py.Group):
            return f"this node's file has no group {rank_group(entry.rank)} of rank {entry.rank}"
        g = group
    a = g.attrs
    rank, step = _int(a.get("rank")), _int(a.get("step"))
    if rank != entry.rank or step != m.step:
        return (f"its attributes say it is rank {rank}'s shard of step {step}, not rank "
                f"{entry.rank}'s of step {m.step}: swapped between ranks or copied from another "
                "checkpoint")
    if _int(a.get("world_size")) != m.world_size:
        return f"its attributes say world size {a.get('world_size')}, not {m.world_size}"
    try:
        tree = json.loads(_str(a.get("tree")))
    except (ValueError, RecursionError):
        tree = None
    if tree != entry.tree:
        return "its 'tree' attribute differs from the state tree in the manifest"
    for r in entry.tensors:
        if r.source is not None:  # an incremental record: its dataset is in an older shard
            continue
        where = f"{TENSORS_GROUP}/{r.name}"
        ds = g.get(where)
        if not isinstance(ds, h5py.Dataset):
            return f"tensor {r.name!r}: no dataset {where}"
        if r.codec is not None:
            why = _compare_chunks(ds, r)
            if why is not None:
                return f"tensor {r.name!r}: {why}"
            continue
        offset = ds.id.get_offset() if r.nbytes else 0
        if list(ds.shape) != list(r.shape) or offset != r.offset or \
                _str(ds.attrs.get("torch_dtype")) != r.dtype or \
                ds.id.get_storage_size() != r.nbytes:
            return (f"tensor {r.name!r}: the dataset is {_str(ds.attrs.get('torch_dtype'))}"
                    f"{list(ds.shape)} at offset {offset}, the manifest {r.dtype}{r.shape} at "
                    f"{r.offset}")
        if r.checksums and _str(ds.attrs.get("xxh3_64")) != ",".join(r.checksums):
            return f"tensor {r.name!r}: its 'xxh3_64' attribute differs from the manifest"
    return None


def _compare_chunks(ds: h5py.Dataset, r: TensorRecord) -> str | None:
    """A compressed record's dataset: one-dimensional, the recorded dtype, the chunks where the
    manifest says."""
    numel = r.nbytes // max(itemsize(r.dtype), 1)
    if ds.shape != (numel,) or _str(ds.attrs.get("torch_dtype")) != r.dtype:
        return (f"the compressed dataset is {_str(ds.attrs.get('torch_dtype'))}{list(ds.shape)},"
                f" the manifest {r.dtype}[{numel}]")
    got = [[int(i.byte_offset), int(i.size)]
           for i in (ds.id.get_chunk_info(k) for k in range(ds.id.get_num_chunks()))]
    if sorted(got) != sorted(r.chunks or []):
        return "its compressed chunks are not where the manifest says"
    return None
