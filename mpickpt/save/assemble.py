"""Stage 3's first half, the vote: every rank's entry (or why it has none) goes to rank 0, which
makes the manifest.

One gather is the vote and the assembly at once: a rank that could not write or protect its
shard sends its reason instead of its entry, and rank 0 aborts the save with a
:class:`~mpickpt.errors.RankFailure` of phase ``"vote"`` per such rank. Otherwise the ranks'
entries become the :class:`~mpickpt.format.manifest.Manifest` by the rules a parsed one obeys;
the pieces of every sharded tensor must tile it (:func:`check_pieces`), and the older shards an
incremental checkpoint refers to must still be there (:func:`check_sources`). A rank that failed
while sending its entry is named, and the save aborts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, NamedTuple

from .. import faults, knobs, sharding
from ..errors import CheckpointError, RankFailure
from ..format import checksum, rootdir
from ..format.entry import IndexRef, RankEntry
from ..format.manifest import Manifest, Memo
from ..format.names import REPLICATED_PART
from ..mpi.protocol import Protocol
from . import metadata as user_metadata
from .incremental import size_problem
from .request import SaveRequest
from .shards import error_text

FAILED = "failed"  # the key of a rank's payload that says why it has no entry


class Vote(NamedTuple):
    """What the vote leaves rank 0 (elsewhere: nothing): the manifest to commit, or why there is
    none, and the failure of each rank that could not write or protect its shard."""

    manifest: Manifest | None
    error: str | None
    failures: tuple[RankFailure, ...] = ()


def assemble(proto: Protocol, run_id: str, req: SaveRequest, partial: str,
             entry: RankEntry | None, error: str | None, block: int, extended: bool,
             logger: logging.Logger, memo: Memo | None = None) -> Vote:
    """Collective (the phase ``"vote"``): rank 0's manifest of step ``req.step`` from every
    rank's ``entry``, or why it cannot be made; ``error``: why this rank has no entry. Rank 0's
    time for it is ``req.stats["commit_s"]`` (the store's publish adds its own); ``memo``: rank
    0's entries of the last manifest, not parsed nor serialized again if a rank sends the
    same."""
    step, rank = req.step, proto.rank
    payload: dict[str, Any] | None = None
    try:
        if error is not None:
            payload = {FAILED: error}
        else:
            if rank != 0:  # voting yes; rank 0 cannot write the manifest without its entry
                faults.hit("after-vote-before-manifest", rank, step)
            if entry is not None and entry.index is None:  # the records inline, in the manifest
                payload = entry.to_dict()
            elif entry is not None:  # a summary, and the records of the replicated part
                payload = entry.summary()
                shared = replicated_records(entry, req.placements, proto.size)
                if shared is not None:
                    payload["replicated"] = shared
    except Exception as e:  # rank 0 aborts the commit, naming this rank
        payload = {"error": f"rank {rank}: {error_text(e)}"}
    entries = proto.gather(payload, "vote", flat=True)
    if rank != 0:  # rank 0 commits while this rank waits for the outcome
        try:
            faults.hit("mid-manifest-write", rank, step)
        except Exception as e:  # rank 0 decides alone now: wait for its outcome
            logger.error("rank %d: %s while rank 0 commits step %d", rank, error_text(e), step)
        return Vote(None, None)
    failures = tuple(RankFailure(r, "vote", str(e[FAILED])) for r, e in enumerate(entries or [])
                     if isinstance(e, dict) and FAILED in e)
    if failures:
        return Vote(None, "; ".join(map(str, failures)), failures)
    t = time.perf_counter()
    try:
        faults.hit("after-vote-before-manifest", 0, step)
        failed = [e["error"] for e in entries or [] if e and "error" in e]
        if failed:
            raise CheckpointError("; ".join(failed))
        metadata = user_metadata.resolve(req.metadata)
        replicas = [{"rank": i, **e.pop("replicated")} for i, e in enumerate(entries or [])
                    if isinstance(e, dict) and "replicated" in e]
        manifest = Manifest.assemble(step, proto.size, run_id, entries or [],
                                     metadata, block, directory=partial, extended=extended,
                                     replicated=write_replicated(partial, replicas),
                                     memo=memo)
        # with index parts, reading every part to check the tiling is for small jobs; beyond,
        # a restore checks the pieces it reads (and names any that do not tile)
        if not manifest.split or proto.size <= knobs.CHECK_PIECES_RANKS.get():
            check_pieces(manifest.ranks)  # with index parts: reads them all
            check_sources(partial, manifest.ranks)
    except Exception as e:
        return Vote(None, f"rank 0: commit failed: {error_text(e)}")
    req.stats.update(bytes=manifest.total_bytes, commit_s=time.perf_counter() - t)
    return Vote(manifest, None)


def replicated_records(entry: RankEntry, placements: dict[str, sharding.Placement],
                       world: int) -> dict[str, Any] | None:
    """What this rank sends rank 0 for the replicated part: the records it wrote of the tensors
    every rank holds alike (and the older shards they refer to), or None if it wrote none."""
    mine = [r for r in entry.tensors if (p := placements.get(r.name)) is not None
            and p.holders is not None and world > 1 and len(p.holders) == world]
    if not mine:
        return None
    out: dict[str, Any] = {"tensors": [r.to_dict() for r in mine]}
    sources = {r.source: entry.sources[r.source] for r in mine if r.source is not None}
    if sources:
        out["sources"] = sources
    return out


def write_replicated(partial: str, replicas: list[dict[str, Any]]) -> IndexRef | None:
    """Rank 0, at the commit: the replicated part (``{"ranks": replicas}``) written durably
    into ``partial``; where the manifest finds it. None when no rank wrote such records."""
    if not replicas:
        return None
    data = json.dumps({"ranks": replicas}, allow_nan=False).encode()
    path = os.path.join(partial, REPLICATED_PART)
    rootdir.make_dirs(os.path.dirname(path))
    rootdir.atomic_write(path, data)
    return IndexRef(REPLICATED_PART, len(data), checksum.digest(data))


def check_pieces(ranks: list[RankEntry]) -> None:
    """Before the commit: the written pieces of every sharded or replicated tensor must tile it
    exactly (ValueError, which aborts the save, otherwise)."""
    pieces: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]]]
    pieces = {}
    for e in ranks:
        for r in e.tensors:
            if r.global_shape is not None and r.offsets is not None:
                pieces.setdefault(r.name, []).append(
                    (e.rank, tuple(r.global_shape), tuple(r.offsets), tuple(r.shape), r.dtype))
    sharding.check_coverage(pieces)


def check_sources(partial: str, ranks: list[RankEntry]) -> None:
    """Before the commit of an incremental checkpoint, on rank 0: the older shards its records
    refer to are still there, of the sizes they were written with (a prune while it was
    written would leave it unloadable)."""
    for e in ranks:
        for f in e.files(partial)[1:]:
            why = size_problem(f.path, f.bytes)
            if why is not None:
                raise CheckpointError(f"rank {e.rank} refers to an older shard: {why}")
