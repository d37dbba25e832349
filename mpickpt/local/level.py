"""The node-local level's settings and the plain file work of its stages.

A :class:`LocalLevel` (made by :func:`open_level` from a :class:`~mpickpt.options.Local`) is what
a Checkpointer with ``local=`` hands its save pipeline: this node's directory
(:class:`~mpickpt.local.nodedir.NodeDir`), the redundancy (an
:class:`~mpickpt.local.exchange.Exchange`, or None), how often a protected checkpoint is drained to
ROOT, how many stay on the nodes, and the node's budget for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import knobs, log
from ..errors import LocalTierFull
from ..format import rootdir
from ..format.names import shard_name
from ..format.shard import size_bound
from .exchange import Exchange
from .nodedir import NodeDir, parity_name
from .pool import Mapped, Maps
from .topology import Topology, partner_source, team_of

if TYPE_CHECKING:
    from ..mpi.protocol import Protocol
    from ..options import Files, Local
    from ..save.request import SaveRequest


@dataclass
class LocalLevel:
    """One rank's view of the node-local level."""

    nodedir: NodeDir
    topology: Topology
    rank: int
    scheme: str | None
    teams: list[list[int]]
    exchange: Exchange | None
    persist_every: int | None
    keep: int
    budget: int | None  # bytes per node, for the local checkpoints kept and the one written
    drain_bandwidth: float | None  # bytes per second per rank, None: as fast as it goes
    alignment: int  # of the shards' tensors (Files(alignment=))
    block: int  # the shards' checksum block (Files(checksum_block=))
    shards: list[int] = field(default_factory=list)  # every rank's, at most: the first save's
    maps: Maps = field(default_factory=Maps)  # this rank's files kept mapped between saves

    @property
    def leader(self) -> bool:
        """Whether this rank writes its node's shared files (the lowest rank of the node)."""
        return self.topology.leader(self.rank) == self.rank

    def take(self, directory: str, name: str) -> Mapped:
        """This rank's file ``directory/name`` of a save, recycled from the pool when it can
        be, open and mapped (:meth:`Maps.take`); ``directory`` is made if need be."""
        rootdir.make_dirs(directory)
        return self.maps.take(self.nodedir.pool_dir, directory, name)

    def close(self) -> None:
        """Let go of the exchange's buffers and the files kept mapped."""
        if self.exchange is not None:
            self.exchange.free()
        self.maps.close()

    def names(self, rank: int) -> str:
        """The file name of what this rank stores for ``rank`` (a partner copy: the shard's own
        name; XOR: its parity)."""
        return shard_name(rank) if self.scheme == "partner" else parity_name(rank)

    def level_record(self) -> bytes:
        """LEVEL.json: the redundancy layout, the same on every node."""
        return json.dumps({"scheme": self.scheme, "nodes": list(self.topology.nodes),
                           "teams": self.teams}).encode()

    def need(self, shards: list[int], rank: int) -> int:
        """The node-local bytes one checkpoint takes at most on ``rank``: its shard and the
        partner copy or parity it stores (``shards``: every rank's shard, at most). A parity is
        as large as its team's largest shard over the team's size less one."""
        if self.scheme == "partner":
            stored = shards[partner_source(self.teams, rank)]
        elif self.scheme == "xor":
            team = team_of(self.teams, rank)
            stored = -(-max(shards[k] for k in team) // (len(team) - 1))
        else:
            stored = 0
        return shards[rank] + stored

    def check_room(self, shards: list[int], rank: int) -> None:
        """Refuse a checkpoint the node cannot hold: ``keep`` kept ones and the one being
        written must fit the budget, and this rank's part of the one being written the free
        space (``shards``: every rank's shard, at most, :func:`~mpickpt.format.shard.size_bound`).
        """
        need = self.need(shards, rank)
        ranks = self.topology.ranks_of(self.topology.nodes[rank])
        one = sum(self.need(shards, r) for r in ranks)
        if self.budget is not None and one * (self.keep + 1) > self.budget:
            raise LocalTierFull(
                f"rank {rank}: the local level {self.nodedir.dir} needs up to "
                f"{log.human_bytes(one)} per checkpoint on this node ({len(ranks)} ranks, "
                f"{log.human_bytes(sum(shards[r] for r in ranks))} of shards, redundancy "
                f"{self.scheme}), {log.human_bytes(one * (self.keep + 1))} for the {self.keep} "
                f"kept and the one being written; its budget is Local(budget={self.budget}) "
                f"({log.human_bytes(self.budget)}). Raise the budget, keep fewer "
                "(Local(keep=)), or use another local directory")
        free = self.nodedir.free() + self.recyclable()
        if free < need:
            raise LocalTierFull(
                f"rank {rank}: the local level {self.nodedir.dir} has {log.human_bytes(free)} "
                f"free, and this rank's part of the checkpoint needs up to "
                f"{log.human_bytes(need)}: free space there, or keep fewer local checkpoints "
                "(Local(keep=))")

    def bound(self, request: SaveRequest) -> int:
        """The bytes of this rank's shard of ``request``, at most (0 without a snapshot)."""
        snap, tree = request.snapshot, request.tree
        if snap is None or tree is None:
            return 0
        return size_bound(snap.nbytes, snap.count, len(json.dumps(tree).encode()),
                          alignment=self.alignment, block=self.block)

    def check_save(self, request: SaveRequest) -> None:
        """:meth:`check_room` for a later save, on this rank alone: its own shard as it is
        now, the others' as at the first save."""
        shards = self.shards or [0] * len(self.topology.nodes)
        self.check_room([*shards[:self.rank], self.bound(request), *shards[self.rank + 1:]],
                        self.rank)

    def recyclable(self) -> int:
        """Bytes of this rank's files in the pool, which its next save writes over (its shard,
        and the copy or parity it stores)."""
        held = (partner_source(self.teams, self.rank) if self.scheme == "partner"
                else self.rank)
        names = {shard_name(self.rank), self.names(held)} if self.scheme else {
            shard_name(self.rank)}
        total = 0
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(self.nodedir.pool_dir, name)).st_blocks * 512
        return total

    def agree_room(self, proto: Protocol, request: SaveRequest,
                   logger: logging.Logger) -> str | None:
        """Collective, at the first save: can every node hold the checkpoints it must keep?
        Why not (every node's reasons), or None."""
        why, snap = None, request.snapshot
        with proto.fatal_timeouts(logger):
            self.shards = proto.allgather(self.bound(request), "local-room")
        if snap is not None:
            try:
                self.check_room(self.shards, self.rank)
            except LocalTierFull as e:
                why = str(e)
        with proto.fatal_timeouts(logger):
            failed = proto.agree(why, "local-room")
        return None if failed is None else str(failed)


def open_level(proto: Protocol, local: Local, files: Files, root: str, run_id: str,
               logger: logging.Logger) -> LocalLevel:
    """The node-local level ``local`` describes (it checked its own settings): find the nodes
    and the redundancy teams, prepare this node's directory (its leader does; a failure on one
    node raises on every rank). Collective."""
    redundancy, persist_every = local.redundancy, local.persist_every
    base = os.path.abspath(os.fspath(local.path))
    if base == root or base.startswith(root + os.sep):
        raise ValueError(f"local={base} is ROOT or inside it: the node-local level must be "
                         "another directory, on each node's own storage")
    with proto.fatal_timeouts(logger):
        nodes = proto.nodes(knobs.NODE.get())
    topo = Topology(tuple(nodes))
    teams = topo.teams(redundancy, local.xor_set) if redundancy else []
    nodedir = NodeDir(base, nodes[proto.rank], root)
    leader = topo.leader(proto.rank) == proto.rank
    proto.everywhere(lambda: nodedir.prepare(run_id, logger) if leader else None, "local",
                     logger)
    with proto.fatal_timeouts(logger):
        exchange = Exchange(proto, teams, redundancy) if redundancy else None
    if proto.rank == 0:
        logger.info("local level %s on %d node(s), redundancy %s, drained to ROOT every %s "
                    "save(s)", base, len(topo.names), redundancy, persist_every or "no")
    return LocalLevel(nodedir, topo, proto.rank, redundancy, teams, exchange, persist_every,
                      local.keep, local.budget, local.drain_bandwidth, files.alignment,
                      files.checksum_block)
