"""One file per node (``Checkpointer(files="per-node")``): the ranks of a node write disjoint,
aligned regions of one shard, so a checkpoint is one data file per node instead of one per rank
(fewer creations, fsyncs and directory entries on the parallel file system's metadata servers).

The sequence, over the node's ranks (a :class:`~mpickpt.mpi.protocol.Protocol` of their own, the
leader first):

1. every rank sends its tensors' names, dtypes and shapes and its attributes to the leader
   (gather);
2. the leader lays the file out (HDF5, one group ``rank-RRRRR`` per rank, every dataset allocated
   and aligned, never filled) and sends each rank its records (broadcast);
3. every rank writes and hashes its tensors into its regions with the same threads and
   positional writes as into a file of its own (:meth:`mpickpt.format.shard.ShardWriter.region`);
4. the leader gathers the checksums, records them as attributes, closes HDF5 and fsyncs the
   file once for the node (the node's ranks share one page cache, or one client of a parallel
   file system); the file's size is broadcast.

With index parts, :func:`write_index` then writes one part per node, its ranks' entries.

A rank that failed takes part in every step all the same, with its error, so that no rank of
the node waits for it; the save then aborts on every rank at the vote. A rank killed mid-way
leaves the others waiting at the next step, until the deadline ends the job (as at the vote).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..mpi.protocol import Protocol
from . import checksum, dtypes, rootdir
from .entry import IndexRef, RankEntry
from .names import node_index_name, node_name
from .records import TensorRecord, rank_group
from .shard import ShardWriter


@dataclass(frozen=True)
class NodeFiles:
    """The ranks of this rank's node, as a Protocol (the leader is its rank 0), and which node
    of how many it is."""

    proto: Protocol
    node: int
    nodes: int
    fanout: int

    @property
    def leader(self) -> bool:
        return self.proto.rank == 0

    def name(self) -> str:
        """The node's file, relative to the checkpoint's directory."""
        return node_name(self.node, self.nodes, self.fanout)


def _spec(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    return [(n, dtypes.name_of(t.dtype), list(t.shape)) for n, t in tensors.items()]


def _meta(spec: list[tuple[str, str, list[int]]]) -> dict[str, torch.Tensor]:
    """Tensors of these names, dtypes and shapes, holding no memory (the layout needs no more)."""
    return {n: torch.empty(shape, dtype=dtypes.torch_dtype(d), device="meta")
            for n, d, shape in spec}


def write(nf: NodeFiles, path: str, rank: int, tensors: Mapping[str, torch.Tensor] | None,
          attrs: Mapping[str, str | int], error: str | None, *, alignment: int, block: int,
          threads: int, on_block: Callable[[], None] | None = None,
          digests: Mapping[str, list[str]] | None = None,
          times: dict[str, float] | None = None) -> tuple[list[TensorRecord], int]:
    """Write this rank's ``tensors`` into the node's file ``path`` (collective over the node);
    its records and the file's size once the leader sealed it. ``error``: this rank failed
    before (``tensors`` is then None); it still takes part, and every rank of the node raises.
    ``times`` receives ``create_s``, ``data_s`` and ``seal_s``."""
    t0 = time.perf_counter()
    mine: Any = (rank, _spec(tensors), dict(attrs)) if error is None and tensors is not None \
        else {"error": error or f"rank {rank}: no snapshot"}
    specs = nf.proto.gather(mine, "node-layout")
    layout: ShardWriter | None = None
    laid: Any = None
    if nf.leader:
        assert specs is not None
        failed = [s["error"] for s in specs if isinstance(s, dict)]
        if failed:
            laid = {"error": "; ".join(failed)}
        else:
            try:
                layout, parts = ShardWriter.node_file(
                    path, [(rank_group(r), _meta(spec), a) for r, spec, a in specs],
                    alignment=alignment)
                laid = parts
            except Exception as e:
                laid = {"error": f"rank {rank}: laying out {path}: {type(e).__name__}: {e}"}
    try:
        laid = nf.proto.bcast(laid, "node-records")
        if isinstance(laid, dict):
            raise RuntimeError(laid["error"])
        records: list[TensorRecord] = laid[nf.proto.rank]
        t1 = time.perf_counter()
        why = None
        try:
            assert tensors is not None
            w = ShardWriter.region(path, records)
            try:
                w.write(tensors, block=block, threads=threads, on_block=on_block,
                        digests=digests)
            finally:
                w.close()
        except OSError as e:
            why = f"rank {rank}: {os.strerror(e.errno or 0)}: {e.filename or path}"
        except Exception as e:
            why = f"rank {rank}: {type(e).__name__}: {e}"
        t2 = time.perf_counter()
        sums = nf.proto.gather(why or [r.checksums for r in records], "node-seal")
        sealed: Any = None
        if layout is not None:
            assert sums is not None
            sealed = _seal(layout, sums)
            layout = None
        sealed = nf.proto.bcast(sealed, "node-sealed")
        if isinstance(sealed, str):
            raise RuntimeError(sealed)
        if times is not None:
            times.update(create_s=t1 - t0, data_s=t2 - t1, seal_s=time.perf_counter() - t2)
        return records, int(sealed)
    finally:
        if layout is not None:
            layout.close()


def write_index(nf: NodeFiles, partial: str, entry: RankEntry | None, error: str | None
                ) -> IndexRef:
    """The node's index part (collective over the node): every rank's entry, gathered by the
    leader into ``{"ranks": [...]}`` and written durably; where it is, for each rank's summary.
    A rank without an entry (``error``) still takes part, and every rank of the node raises."""
    mine: Any = entry.to_dict() if entry is not None and error is None else \
        {"error": error or f"rank {nf.proto.rank}: no entry"}
    entries = nf.proto.gather(mine, "node-index")
    ref: Any = None
    if nf.leader:
        assert entries is not None
        failed = [e["error"] for e in entries if "error" in e]
        if failed:
            ref = "; ".join(failed)
        else:
            name = node_index_name(nf.node, nf.nodes, nf.fanout)
            try:
                data = json.dumps({"ranks": entries}, allow_nan=False).encode()
                path = os.path.join(partial, name)
                rootdir.make_dirs(os.path.dirname(path))
                rootdir.atomic_write(path, data)
                ref = IndexRef(name, len(data), checksum.digest(data))
            except Exception as e:
                ref = f"writing the node's index part {name}: {type(e).__name__}: {e}"
    ref = nf.proto.bcast(ref, "node-indexed")
    if isinstance(ref, str):
        raise RuntimeError(ref)
    return ref


def _seal(layout: ShardWriter, sums: list[Any]) -> int | str:
    """On the leader: every rank's checksums into the layout's records, then seal; the file's
    size, or what went wrong."""
    failed = [s for s in sums if isinstance(s, str)]
    if failed:
        layout.close()
        return "; ".join(failed)
    flat = [c for rank_sums in sums for c in rank_sums]
    try:
        for r, c in zip(layout.records, flat, strict=True):
            r.checksums = list(c)
        return layout.seal()
    except Exception as e:
        return f"sealing {layout.path}: {type(e).__name__}: {e}"
