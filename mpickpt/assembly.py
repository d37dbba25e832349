"""What the Checkpointer assembles: the save pipeline with its stores, and the node-local level
with its recovery. The facade (:mod:`mpickpt.checkpointer`) calls these once, at construction;
nothing here runs a save or a restore."""

from __future__ import annotations

import logging

from . import knobs
from .format.nodefile import NodeFiles
from .local.level import LocalLevel, open_level
from .local.nodestore import NodeStore
from .local.recovery import LocalRecovery
from .local.topology import Topology
from .mpi.protocol import Protocol
from .options import Options
from .save.incremental import Tracker
from .save.pipeline import Pipeline
from .save.retention import Policy
from .save.rootstore import RootStore
from .save.shards import RankShards, ShardOptions
from .save.snapshot import Snapshotter
from .save.upkeep import Upkeep


def pipeline(proto: Protocol, root: str, run_id: str, snapshotter: Snapshotter,
             options: ShardOptions, policy: Policy, lv: LocalLevel | None,
             logger: logging.Logger, *, raise_on_error: bool, skip: bool) -> Pipeline:
    """The save pipeline: its stores (ROOT's; the node store first with a local level ``lv``)
    and what they write with. Collective with ``Files(per="node")`` (the node's ranks meet)."""
    tracker = Tracker(root, options.incremental, options.frozen) \
        if options.incremental else None
    shards = RankShards(proto.rank, proto.size, options, tracker, logger)
    node = node_files(proto, options.fanout, logger) if options.per_node else None
    # a retired shard is written over by the next save where that save writes a rank's shard
    # whole, through its template or as a drain's copy: not compressed, not a node's file
    recycle = options.compression is None and node is None
    root_store = RootStore(proto, root, run_id, shards,
                           Upkeep(root, run_id, policy, logger, recycle), logger, node=node)
    if lv is None:
        return Pipeline(proto, run_id, snapshotter, root_store, root_store, logger,
                        raise_on_error, skip=skip)
    return Pipeline(proto, run_id, snapshotter, NodeStore(proto, run_id, lv, shards, logger),
                    root_store, logger, raise_on_error, lv.persist_every, lv.drain_bandwidth,
                    skip)


def local_level(proto: Protocol, options: Options, root: str, run_id: str,
                root_problem: str | None, io_threads: int, logger: logging.Logger
                ) -> tuple[LocalLevel | None, LocalRecovery | None]:
    """The node-local level and its recovery, when ``options.local`` asks for one (collective);
    rank 0 says that the job goes on without ROOT when ``root_problem`` says why it cannot be
    used."""
    if options.local is None:
        return None, None
    lv = open_level(proto, options.local, options.files, root, run_id, logger)
    if root_problem is not None and proto.rank == 0:
        logger.warning(
            "ROOT cannot be used: %s. Restore takes what the node-local level holds; saves are "
            "protected on the nodes, and their drains to ROOT fail (each one says so) until "
            "ROOT is back", root_problem)
    return lv, LocalRecovery(proto, lv, io_threads, logger, run_id)


def node_files(proto: Protocol, fanout: int, logger: logging.Logger) -> NodeFiles:
    """This rank's node and its ranks, for ``Files(per="node")`` (collective)."""
    with proto.fatal_timeouts(logger):
        topo = Topology(tuple(proto.nodes(knobs.NODE.get())))
        node = topo.node_index(proto.rank)
        team = proto.sub(node, topo.local_index(proto.rank))
    return NodeFiles(team, node, len(topo.names), fanout)
