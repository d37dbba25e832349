"""A coordinated restore, as the Checkpointer runs it: the candidates every level offers (ROOT's
committed steps, the node-local level's loadable ones, less what a rollback undid), the newest
that every rank can load (:class:`~mpickpt.restore.restorer.Restorer`), the job's totals, and
rank 0's account of it in the log."""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import log
from ..errors import CheckpointError
from ..format.manifest import Manifest
from ..format.rollback import Rollback
from ..local.recovery import LocalRecovery
from ..mpi.protocol import Protocol
from ..ranks import ranks_text
from ..save.pinned_pool import HostPool
from .restorer import RestoreInfo, Restorer

Listing = tuple[list[tuple[int, str]], Rollback | None, str | None]  # see rootstart.listing


def restore(proto: Protocol, pool: HostPool, state: dict[str, Any], root: str, listed: Listing,
            recovery: LocalRecovery | None, logger: logging.Logger, *, step: int | None,
            upto: int | None, io_threads: int, replicated: tuple[str, ...], world_change: str,
            share: int = 0) -> tuple[RestoreInfo, Manifest | None]:
    """Collective: load the newest checkpoint every rank can load (of ``step``, or no later
    than ``upto``) into ``state``, from ROOT (``listed`` by rank 0) or the node-local level
    (``recovery``); what was loaded, and the manifest it was loaded from (ROOT). ``share``:
    the saves' Files(min_write_share=), where the replicated tensors' records are looked for
    first."""
    t0 = time.perf_counter()
    with proto.fatal_timeouts(logger):
        asked = proto.allgather((step, upto), "restore")
    if len(set(asked)) > 1:  # else each rank waits for others that load another step
        by: dict[tuple[int | None, int | None], list[int]] = {}
        for r, a in enumerate(asked):
            by.setdefault(a, []).append(r)
        raise CheckpointError(
            "restore() was called with other arguments on other ranks (" + "; ".join(
                f"{ranks_text(rs)}: step={s}, upto={u}" for (s, u), rs in by.items())
            + "): every rank must ask for the same checkpoint; nothing was restored")
    candidates, undo, unlisted = listed
    if unlisted is not None and recovery is None:
        raise CheckpointError(f"cannot list the checkpoints under ROOT: {unlisted}")
    candidates = [c for c in candidates if _wanted(c[0], step, upto)]
    with proto.fatal_timeouts(logger):
        local_steps = recovery.steps(undo) if recovery is not None else []
        local_steps = [s for s in local_steps if _wanted(s, step, upto)]
    if step is not None and not candidates and not local_steps:
        raise CheckpointError(f"no checkpoint of step {step} under {root}"
                              + (" or in the local level" if recovery else ""))
    with proto.fatal_timeouts(logger):
        restorer = Restorer(proto, pool, io_threads, logger, replicated, world_change, share)
        info = restorer.run(state, candidates, explicit=step is not None, local=recovery,
                            local_steps=local_steps)
        info.total_bytes_read, info.total_network_bytes, fetched = proto.sums(
            [info.bytes_read, info.network_bytes, info.fetched_bytes], "restored")
        if info.level == "local":
            info.total_fetched_bytes = fetched
        info.root_bytes = info.total_bytes_read if info.level == "root" else 0
    info.seconds = time.perf_counter() - t0
    if proto.rank == 0 and (info.step is not None or unlisted is None):  # else: refused
        _account(info, root, proto.size, logger)
    return info, restorer.manifest


def _wanted(s: int, step: int | None, upto: int | None) -> bool:
    return (step is None or s == step) and (upto is None or s <= upto)


def _account(info: RestoreInfo, root: str, world_size: int, logger: logging.Logger) -> None:
    """Rank 0's log lines of a restore."""
    if info.step is None:
        logger.info("no loadable checkpoint under %s: fresh start%s", root,
                    f" ({len(info.skipped)} skipped)" if info.skipped else "")
        return
    where = info.path if info.level == "root" else "the local level"
    logger.info("restored step %d from %s in %.2f s: %s read by %d rank(s), %s%s", info.step,
                where, info.seconds, log.human_bytes(info.total_bytes_read), world_size,
                log.human_rate(info.total_bytes_read / max(info.seconds, 1e-9)),
                f", {log.human_bytes(info.total_network_bytes)} rebuilt over the network"
                if info.total_network_bytes else "")
    if info.total_fetched_bytes:
        logger.info("step %d: %s of shards of other nodes sent over the network (replicated or "
                    "resharded tensors)", info.step, log.human_bytes(info.total_fetched_bytes))
