"""A candidate checkpoint opened for a restore, before anything is allocated for it: its
manifest as rank 0 reads it and broadcasts it, checked against this job (its step, its number of
ranks), and the records of the shards a rank will read checked against their files' sizes.
Collective where it says so (MPI only through :class:`~mpickpt.mpi.protocol.Protocol`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ManifestError, WorldSizeMismatchError
from ..format.entry import RankEntry
from ..format.manifest import NAME as MANIFEST
from ..format.manifest import Manifest, read_bytes
from ..format.records import check_file, check_records
from ..mpi.protocol import Protocol
from . import reshard


def open_manifest(proto: Protocol, path: str, step: int, world_size: int, world_change: str,
                  log: logging.Logger, known: Manifest | None = None
                  ) -> tuple[Manifest | None, str | None]:
    """Collective: the manifest of step ``step`` at ``path`` as rank 0 reads it (or ``known``,
    the one every rank parsed already), checked against a job of ``world_size`` ranks (another
    number: refused with ``world_change="fail"``, else said and resharded), or why it cannot be
    loaded."""
    if known is not None:
        manifest = known
    else:
        text, reason = proto.bcast(read_manifest(path) if proto.rank == 0 else None, "manifest")
        if text is None:
            return None, reason
        try:
            manifest = Manifest.from_json(text, os.path.join(path, MANIFEST))
        except ManifestError as e:
            return None, str(e)
    if manifest.step != step:
        return None, (f"{os.path.join(path, MANIFEST)} is the manifest of step "
                      f"{manifest.step}, not of step {step}: it was copied or moved here")
    if manifest.world_size != world_size:
        if world_change == "fail":
            raise WorldSizeMismatchError(
                f"{path} was written by {manifest.world_size} ranks, this job has "
                f"{world_size}; restore it with the same number of ranks, or with "
                "world_change='reshard'")
        if proto.rank == 0:
            # the same on N >= 2 stored ranks: in effect global state, any copy will do
            # (not looked at through index parts: that would read every rank's)
            same = (manifest.world_size > 1 and not manifest.split
                    and not per_rank_state_differs(manifest))
            (log.info if same else log.warning)(
                "%s was written by %d ranks, this job has %d: sharded and replicated tensors "
                "are resharded; rank r takes the per-rank state (other tensors and values) "
                "of stored rank r mod %d%s", path, manifest.world_size, world_size,
                manifest.world_size, " (it is the same on every stored rank)" if same else "")
    return manifest, None


def read_manifest(path: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason)."""
    try:
        return read_bytes(path).decode("utf-8", errors="replace"), None
    except ManifestError as e:
        return None, str(e)


def per_rank_state_differs(manifest: Manifest) -> bool:
    """Whether the stored ranks' per-rank state differs (values in the trees, or the checksums of
    per-rank tensors), i.e. whether the ``r mod N`` rule matters; device names are ignored."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "device"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    def signature(e: RankEntry) -> tuple[Any, ...]:
        own = [(r.name, r.dtype, r.shape, r.checksums) for r in e.tensors if r.global_shape is None]
        return strip(e.tree), own

    first = signature(manifest.ranks[0])
    return any(signature(e) != first for e in manifest.ranks[1:])


def check_entry(rank: int, entry: RankEntry, directory: str, block: int) -> None:
    """The records of ``entry`` fit the sizes of the files they lie in, as the manifest gives
    them (:class:`ShardError` otherwise); before anything is allocated for them."""
    for f in entry.files(directory):  # incremental: older shards too
        check_records(rank, f.path, f.records, f.bytes, block)


def check_entries(plan: reshard.Plan, ranks: set[int], directory: str, block: int) -> None:
    """:func:`check_entry` for each of these ranks' entries in ``plan``."""
    for src in sorted(ranks):
        check_entry(src, plan.entries[src], directory, block)


def check_files(plan: reshard.Plan, ranks: set[int], directory: str) -> None:
    """Each of these ranks' shards is a regular file of the size its manifest gives
    (:class:`ShardError` otherwise); before anything is allocated for it."""
    for src in sorted(ranks):
        for f in plan.entries[src].files(directory):
            check_file(src, f.path, f.bytes)
