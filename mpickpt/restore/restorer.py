"""Coordinated restore: all ranks agree on the newest checkpoint every one of them can load.

For each candidate, newest first: rank 0 reads the manifest and broadcasts it; every rank checks
that its part fits the state (a dry run of :func:`mpickpt.format.state_apply.apply`), reads its
shard into a reused host buffer and verifies sizes and checksums; an allreduce (MAX of verdicts)
decides. Only when every rank succeeded is anything copied into the state. A corrupt or unreadable
candidate makes all ranks move to the next older one; a checkpoint that does not fit the state
(another model) raises :class:`StateMismatchError` on every rank, since older ones will not fit
either. A checkpoint of another number of ranks is resharded (:mod:`mpickpt.restore.reshard`):
sharded and replicated tensors are assembled from the stored pieces that overlap each rank's new
piece, and rank ``r`` gets the per-rank values of stored rank ``r mod N``; with
``world_change="fail"`` it raises :class:`WorldSizeMismatchError` instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import faults
from ..errors import CheckpointError, ShardError, StateMismatchError
from ..format import rootdir, state_apply
from ..format.iothreads import pool
from ..format.manifest import Manifest
from ..format.reader import Span, let_go_behind
from ..local.recovery import Clock, LocalRecovery
from ..local.remote import fetch as remote_fetch
from ..local.ring import Ring
from ..mpi.protocol import Protocol
from ..save.pinned_pool import HostPool, Taken
from . import opening, provenance, reshard
from .device_room import DeviceRoom

# a lost rank's spans, rebuilt by its XOR team through a ring's page-locked slots or not: its error
Land = Callable[[list[Span], Ring | None], str | None]
_MISSING = "cannot open: No such file or directory"  # a shard that is not there

# verdicts, combined with MAX over ranks
_OK, _CORRUPT, _MISMATCH = 0, 1, 2


@dataclass
class RestoreInfo:
    """What a restore loaded, and which newer checkpoints it skipped and why."""

    step: int | None
    path: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    world_size: int | None = None  # of the job that wrote it
    bytes_read: int = 0  # by this rank
    total_bytes_read: int = 0  # by every rank
    seconds: float = 0.0  # the whole restore, the fallbacks included
    level: str | None = None  # "local" (the node-local level) or "root"
    source: str | None = None  # this rank's shard: "own", "partner copy from rank R",
    #                            "XOR rebuild", "XOR rebuild into the restore" (level
    #                            "local"), or "ROOT"
    network_bytes: int = 0  # received over MPI to rebuild this rank's shard
    total_network_bytes: int = 0  # by every rank
    fetched_bytes: int = 0  # (level "local") bytes of other nodes' shards received to load
    total_fetched_bytes: int = 0  # by every rank
    # (level "local", a node directory in memory) of bytes_read, used where they lie in this
    # node's files: verified in place, never copied into a buffer
    mapped_bytes: int = 0
    # bytes of GPU memory the state's bytes were put in as they came (over MPI, or read from
    # ROOT), taken by the state after the vote (restore/device_room.py)
    room_bytes: int = 0
    root_bytes: int = 0  # read from ROOT by every rank
    # seconds of each phase on this rank (level "local": the recovery's, then "load" and its
    # parts as "load.*"; ROOT: stage, read (own-read the part of it), apply)
    phases: dict[str, float] = field(default_factory=dict)


class Restorer:
    """One coordinated restore over ``proto``'s ranks, reading through ``pool``'s buffers."""

    def __init__(self, proto: Protocol, pool: HostPool, io_threads: int,
                 log: logging.Logger, replicated: tuple[str, ...] = (),
                 world_change: str = "reshard", share: int = 0) -> None:
        self.proto, self.pool, self.io_threads, self.log = proto, pool, io_threads, log
        self.rank, self.world_size = proto.rank, proto.size
        self.replicated, self.world_change, self.share = replicated, world_change, share
        self.bytes_read = 0
        self.mapped_bytes = 0  # of bytes_read, used where they lie (a node directory in memory)
        self.room_bytes = 0  # put in GPU memory set aside while the bytes came
        self.fetched_bytes = 0  # the node-local level: received from other nodes' ranks
        self.served_bytes = 0  # and of its own lost shard, from the rank holding its copy
        self.manifest: Manifest | None = None  # of the checkpoint loaded (or last tried)
        # seconds of the last load's parts on this rank: stage (plan, buffers), fetch (the
        # node-local level's transfer), own-read (this node's shards, beside the fetch),
        # apply (the verify vote, then into the state)
        self.phases: dict[str, float] = {}

    def _plan(self, manifest: Manifest, state: dict[str, Any], where: str) -> reshard.Plan:
        """What this rank reads of ``manifest`` (at ``where``) to restore ``state``."""
        return reshard.plan(manifest, self.rank, self.world_size, state, self.replicated, where,
                            self.share)

    def run(self, state: dict[str, Any], candidates: list[tuple[int, str]], *,
            explicit: bool = False, local: LocalRecovery | None = None,
            local_steps: Sequence[int] = ()) -> RestoreInfo:
        """Load the first candidate every rank can load; ``explicit``: only that step, or
        raise. With ``local``, a step committed on the nodes (``local_steps``) is tried from
        there first, then from ROOT."""
        info = RestoreInfo(None)
        tries = [(s, "root", p) for s, p in candidates]
        tries += [(s, "local", "") for s in local_steps]
        tries.sort(key=lambda t: (t[0], t[1] == "local"), reverse=True)
        for n, (step, level, path) in enumerate(tries):
            if level == "local":
                assert local is not None
                verdict, loaded = self._try_local(state, step, local)
                path = local.path(step)
                info.phases = dict(local.last.phases)
            else:
                verdict, loaded = self._try(state, step, path)
                info.phases = dict(self.phases)
            if verdict is None:
                info.step, info.path, info.metadata = step, path, loaded
                info.world_size, info.bytes_read = self._written_by, self.bytes_read
                info.level = level
                info.source = local.last.source if level == "local" and local else "ROOT"
                info.network_bytes = local.last.received if level == "local" and local else 0
                info.fetched_bytes = self.fetched_bytes if level == "local" else 0
                info.mapped_bytes = self.mapped_bytes if level == "local" else 0
                info.room_bytes = self.room_bytes
                break
            info.skipped.append((step, verdict))
            later = [t for t in tries[n + 1:] if t[0] == step]
            if self.rank == 0:  # (the step asked for: another copy of it, or none)
                self.log.warning("checkpoint step %d cannot be restored%s, %s: %s", step,
                                 " from the local level" if level == "local" else "",
                                 "falling back" if not explicit else "trying its other copy"
                                 if later else "and it is the step asked for", verdict)
            if explicit and not later:
                raise CheckpointError(f"checkpoint step {step} cannot be restored: {verdict}")
        if info.step is None and info.skipped and candidates and self.rank == 0 and all(
                _MISSING in why for _, why in info.skipped):
            self.log.warning("every checkpoint under %s lacks shards of some ranks: %s",
                             os.path.dirname(candidates[0][1]),
                             rootdir.not_shared_hint())
        return info

    def _try_local(self, state: dict[str, Any], step: int, local: LocalRecovery
                   ) -> tuple[str | None, dict[str, Any]]:
        """A step of the local level: first as it is (each own shard present, of its size: the
        load verifies every checksum), and if that fails, once more after every rank verified
        its shard and the damaged or missing ones were rebuilt from redundancy."""
        nodes = local.level.topology.nodes

        def load() -> tuple[str | None, dict[str, Any]]:
            t = time.perf_counter()
            got = self._try(state, step, local.path(step), nodes, local.served,
                            local.manifest, lambda r: local.path_of(r, step), local.land)
            local.last.phases["load"] = time.perf_counter() - t
            local.last.phases.update({f"load.{k}": v for k, v in self.phases.items()})
            if local.served:
                local.last.received = self.served_bytes
            return got

        def needs(manifest: Manifest) -> set[int]:  # the ranks whose shards this one reads
            return {rank for rank, _ in self._plan(manifest, state, local.path(step)).spans}

        # a lost node's shards come straight into the restore from their partner copies, or
        # from their XOR teams
        verdict, loaded = local.prepare(step, verify=False, serve=True, needs=needs), {}
        if verdict is None:
            verdict, loaded = load()
            if verdict is not None:
                if self.rank == 0:
                    self.log.warning("step %d from the local level: %s; verifying every shard "
                                     "and rebuilding the damaged ones", step, verdict)
                verdict = local.prepare(step, verify=True)
                if verdict is None:
                    verdict, loaded = load()
        return (None if verdict is None else f"from the local level: {verdict}"), loaded

    def _try(self, state: dict[str, Any], step: int, path: str,
             nodes: Sequence[str] | None = None, served: dict[int, int] | None = None,
             known: Manifest | None = None, served_from: Callable[[int], str] | None = None,
             land: Land | None = None) -> tuple[str | None, dict[str, Any]]:
        """(None, metadata) once loaded into ``state``; (reason, {}) if it cannot be. With
        ``nodes`` (the node-local level: each rank's node; ``path`` is this node's copy of the
        step, ``known`` its manifest as parsed), the bytes of shards of other nodes' ranks come
        from those ranks, and those of a lost rank's shard from the rank that ``served`` names
        (:mod:`mpickpt.local.remote`; ``served_from(rank)``: the directory that rank serves
        from, which names a damaged copy), or, where ``served`` names the lost rank itself,
        rebuilt by its XOR team straight into its restore (``land``,
        :meth:`~mpickpt.local.recovery.LocalRecovery.land`)."""
        served, self.phases = served or {}, {}  # (no phases of an earlier try, if this fails)
        manifest, reason = opening.open_manifest(
            self.proto, path, step, self.world_size, self.world_change, self.log, known)
        if manifest is None:
            return reason, {}
        self._written_by = manifest.world_size
        self.manifest = manifest
        verdict, err, arrays, held = _OK, None, {}, Taken(self.pool)
        plan = None
        self.mapped_bytes = self.room_bytes = 0
        clock = Clock()
        self.phases = clock.phases

        where, staged, reading, room = path, None, None, None
        remote: dict[int, list[Span]] = {}
        try:
            # records that cannot be are damage (fall back), before they are compared with the
            # state (a mismatch stops the restore) or anything is allocated for them
            source = self.rank % manifest.world_size
            opening.check_entry(source, manifest.ranks[source], path, manifest.checksum_block)
            plan = self._plan(manifest, state, path)
            where = os.path.join(path, *filter(None, [manifest.ranks[source].file]))
            state_apply.apply(plan.tree, state, plan.specs(), dry_run=True)
            needed = {rank for rank, _ in plan.spans}
            opening.check_entries(plan, needed - {source}, path, manifest.checksum_block)
            # (a host buffer page-locked where GPU targets take their bytes from it)
            staged, here, remote, room = self._stage(plan, path, needed, served, nodes,
                                                     held.take, manifest.checksum_block)
            clock.lap("stage")
            if nodes is None:
                self._read_here(staged, manifest, path, here, clock.phases)
            else:  # this node's shards read while the others' bytes come over MPI below
                reading = pool(1, False).submit(self._read_here, staged, manifest, path, here,
                                                clock.phases)
            self.mapped_bytes = sum(src.record.nbytes for src in staged.mapped.values())
            self.bytes_read = self.mapped_bytes + sum(
                s.nbytes for r in here for s in staged.by_rank.get(r, []))
        except Exception as e:
            verdict, err = _verdict(self.rank, e, where, manifest, path)
        if nodes is not None:  # collective: also where this rank failed
            moved, why = self._fetch(remote, manifest, path, verdict != _OK, served,
                                     served_from, room, land)
            clock.lap("fetch")
            if reading is not None:
                try:
                    reading.result()
                except Exception as e:
                    verdict, err = _verdict(self.rank, e, where, manifest, path)
            if not moved:
                verdict, err = max(verdict, _CORRUPT), err or why
        if verdict == _OK and staged is not None:
            arrays = staged.finish()
        clock.lap("read")
        try:
            return self._agree_and_apply(path, manifest, plan, staged, state, arrays, verdict,
                                         err)
        finally:
            clock.lap("apply")
            if staged is not None and staged.maps:  # views of this node's files, let go behind
                let_go_behind([staged.out.pop(n) for n in staged.mapped if n in staged.out],
                              staged.maps)
                staged.maps = []
            arrays.clear()
            held.release()
            staged = remote = reading = None  # (views of the room; a failed read's too)
            if room is not None:
                self.room_bytes = sum(b.numel() for b in room.held)
                room.close()

    def _fetch(self, remote: dict[int, list[Span]], manifest: Manifest, path: str,
               failed: bool, served: dict[int, int], served_from: Callable[[int], str] | None,
               room: DeviceRoom | None, land: Land | None = None) -> tuple[bool, str | None]:
        """The node-local level's transfer (:func:`mpickpt.local.remote.fetch`), then the XOR
        rebuilds that land in their lost ranks' restores (``land``: the ranks ``served``
        names as their own servers), and the bytes this rank received: of its own lost shard,
        and the rest (other ranks' shards, replicated shares)."""
        xor = {r for r, s in served.items() if s == r}
        ring = room.ring if room is not None else None
        got = remote_fetch(self.proto, {r: s for r, s in remote.items() if r not in xor},
                           manifest, path, self.io_threads, failed=failed,
                           servers={r: s for r, s in served.items() if r not in xor},
                           served_from=served_from, ring=ring)
        if xor:
            assert land is not None
            why = land([] if failed else remote.get(self.rank, []), ring)
            if why is not None:
                got = (False, got[1] or why)
        self.served_bytes = sum(s.nbytes for s in remote.get(self.rank, []))
        self.fetched_bytes = sum(s.nbytes for r, spans in remote.items() if r != self.rank
                                 for s in spans)
        return got

    def _read_here(self, staged: reshard.Staged, manifest: Manifest, path: str,
                   here: list[int], phases: dict[str, float]) -> None:
        """Read and verify this node's shards of ``here`` (:meth:`reshard.Staged.read`)."""
        t = time.perf_counter()
        staged.read(manifest, path, here, threads=self.io_threads,
                    on_block=lambda: faults.hit("mid-restore-read", self.rank, manifest.step))
        phases["own-read"] = time.perf_counter() - t

    def _stage(self, plan: reshard.Plan, path: str, needed: set[int], served: dict[int, int],
               nodes: Sequence[str] | None, buffer: Callable[[int, bool], torch.Tensor],
               block: int
               ) -> tuple[reshard.Staged, list[int], dict[int, list[Span]], DeviceRoom | None]:
        """This node's shards of the ``needed`` ranks checked, the targets laid out: (the
        staging, the ranks whose shards are read here, the spans that come from other ranks,
        the room on the GPU it took, if any)."""
        def on_node(r: int) -> bool:
            return r not in served and (nodes is None or nodes[r] == nodes[self.rank])

        # the node-local level: other nodes' shards are their ranks' to check and send
        opening.check_files(plan, {r for r in needed if on_node(r)}, path)
        # the node-local level in memory: this node's shards are mapped (without GPU room)
        in_memory = nodes is not None and rootdir.in_memory(path)
        # bytes over MPI (a lost node's, shares of other nodes' ranks) and those read here
        # (ROOT's, own shards) through page-locked buffers: into GPU memory where it has the
        # room, verified as they come (without it, own shards in memory are mapped)
        moving = bool(served) or not all(map(on_node, needed))
        room = DeviceRoom.find(plan.devices, lambda r: nodes is None or not on_node(r)) \
            if nodes is None or moving or in_memory else None
        staged = reshard.stage(plan, buffer, mappable=on_node if in_memory else None,
                               room=room)
        if room is not None and room.held:  # (its buffers taken as the reads need them)
            staged.bounce = room.take_bounce(block, self.io_threads, self.pool.pin)
        here = sorted({r for r in staged.by_rank if on_node(r)}
                      | {src.rank for src in staged.mapped.values()})
        remote = {r: spans for r, spans in staged.by_rank.items() if r not in here}
        if room is not None and room.held and any(remote.values()):
            room.take_ring(block, self.pool.pin)  # the received bytes' way into the room
        return staged, here, remote, room

    def _agree_and_apply(self, path: str, manifest: Manifest, plan: reshard.Plan | None,
                         staged: reshard.Staged | None, state: dict[str, Any],
                         arrays: dict[str, torch.Tensor], verdict: int, err: str | None
                         ) -> tuple[str | None, dict[str, Any]]:
        verdict = self.proto.max(verdict, "verify")
        if verdict != _OK:
            reasons = "; ".join(filter(None, self.proto.allgather(err, "verify-report")))
            if verdict == _MISMATCH:
                raise StateMismatchError(
                    f"checkpoint {path} does not fit the state being restored: {reasons}")
            return reasons, {}
        err = None
        try:
            assert plan is not None and staged is not None  # (verified: both there)
            state_apply.apply(plan.tree, state, arrays, borrowed=True, keep=staged.owned,
                             onto={n: plan.devices[n] for n in plan.fresh})
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the host->device copies read the reused buffer
        except Exception as e:
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
        if failed := self.proto.agree(err, "apply"):
            raise StateMismatchError(
                f"loading {path} into the state failed after verification; the state is only "
                f"partly restored, restart the job: {failed}")
        return None, manifest.metadata


def _verdict(rank: int, e: Exception, where: str, manifest: Manifest, path: str
             ) -> tuple[int, str]:
    """What a failure to plan or read means: the state does not match, or the checkpoint is
    damaged (named, and whose the shard really is)."""
    if isinstance(e, StateMismatchError):
        return _MISMATCH, f"rank {rank}: {where}: {e}"
    if isinstance(e, ShardError):
        return _CORRUPT, str(e) + provenance.explain(e.rank, e.path, manifest, path)
    return _CORRUPT, f"rank {rank}: {where}: {type(e).__name__}: {e}"
