"""A restore's XOR rebuilds, team by team: each team that lost a member rebuilds it over its
ring (:func:`mpickpt.local.parity.xor_rebuild`), into the lost member's new files or straight
into its restore (:class:`mpickpt.local.xorlanding.XorLanding`). Collective over every rank: each
team's communicator is made."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .. import faults
from ..format import rootdir
from ..format.manifest import Manifest
from ..format.names import shard_name
from ..format.reader import Span
from ..mpi.protocol import Protocol
from .nodedir import parity_name
from .parity import xor_rebuild
from .ring import SLOTS, Ring
from .topology import team_of, xor_chunk_bytes
from .xorlanding import XorLanding, landable_shard

LANDING_BUFFERS = 8  # blocks a lost shard's landing holds: 4 posted ahead, the rest in use


def landable(proto: Protocol, manifest: Manifest, xor_lost: dict[int, int],
             needs: Callable[[Manifest], set[int]] | None) -> bool:
    """Whether the XOR-lost shards can land straight in their ranks' restores: each one's
    records all :func:`~mpickpt.local.xorlanding.landable_shard`, and no other rank's restore
    reads it (``needs(manifest)``: the ranks whose shards a rank's restore reads, gathered;
    collective where given)."""
    if needs is None:
        return False
    try:
        mine: list[int] | None = sorted(needs(manifest))
    except Exception:  # the load that follows says why, or the rebuild goes first
        mine = None
    told = proto.allgather(mine, "local-needs")
    lost = set(xor_lost.values())
    return all(landable_shard(manifest.ranks[r]) for r in lost) and all(
        t is not None and not (set(t) & lost) - {r} for r, t in enumerate(told))


def xor_land(proto: Protocol, d: str, manifest: Manifest, xor_lost: dict[int, int],
             layout: dict[str, Any], spans: list[Span],
             ring: Ring | None, window: int,
             buffers: Callable[[str, int], memoryview]) -> str | None:
    """The XOR teams that lost a member rebuild it: a lost rank's shard lands in ``spans``
    (what its restore reads of it; every byte verified on the way) through the slots of
    ``ring`` (ordinary memory, each swapped for its page-locked twin once that is made beside
    the transfer) or else reused host buffers, in blocks of ``window`` bytes. Collective.
    This rank's error, or None."""
    me = proto.rank
    landing = None
    slots = ring if ring is not None and ring.size >= window else None
    if slots is not None:  # slot by slot, each cut into windows
        bufs = [(lambda i=i, a=a: slots.slot(i)[a:a + window]) for i in range(SLOTS)
                for a in range(0, slots.size - window + 1, window)][:LANDING_BUFFERS]
    else:
        bufs = [(lambda i=i: torch.frombuffer(buffers(f"land{i}", window), dtype=torch.uint8))
                for i in range(LANDING_BUFFERS)]

    if me in xor_lost.values():
        if slots is not None:  # its blocks reach the GPU from page-locked twins, once made
            slots.make_twins()
        landing = XorLanding(me, os.path.join(d, shard_name(me)), manifest.ranks[me].bytes,
                             spans, manifest.checksum_block, bufs)
    err = None
    try:
        xor_team(proto, d, d, manifest, xor_lost, layout, "landing", window, buffers, landing)
    except OSError as e:
        err = f"rank {me}: the XOR rebuild failed: {e}"
    except BaseException:
        if landing is not None:
            landing.abandon()
        raise
    if landing is not None and (failed := landing.finish()) is not None:
        err = err or str(failed)
    return err


def xor_team(proto: Protocol, d: str, out: str, manifest: Manifest, xor_lost: dict[int, int],
             layout: dict[str, Any], parts: str, window: int,
             buffers: Callable[[str, int], memoryview], landing: XorLanding | None = None) -> int:
    """This rank's team's XOR rebuild, if it lost a member (``xor_lost``: team index -> rank):
    ``parts`` "both" its shard and parity into ``out``, "shard" or "parity" one of them (a
    parity alone under another name first, renamed once whole), "landing" its shard into the
    lost member's ``landing`` (which every block then :meth:`~XorLanding.arrived` at) and nothing
    else. The survivors read their files in ``d``. The bytes this rank received."""
    teams: list[list[int]] = layout["teams"]
    me = proto.rank
    team = team_of(teams, me)
    sub = proto.sub(teams.index(team), team.index(me))
    try:
        lost = xor_lost.get(teams.index(team))
        if lost is None:
            return 0
        sizes = [manifest.ranks[m].bytes for m in team]
        parity = os.path.join(out, parity_name(me))
        into = parity + ".rebuilding" if parts == "parity" else parity
        land = landing if parts == "landing" and me == lost else None

        def on_window() -> None:
            faults.hit("mid-rebuild", me, manifest.step)
            if land is not None:
                land.arrived()

        got = xor_rebuild(
            sub, team.index(lost), xor_chunk_bytes(max(sizes), len(team)), sizes,
            os.path.join(d, shard_name(me)), os.path.join(d, parity_name(me)),
            os.path.join(out, shard_name(me)), into, window, buffers, on_window,
            shard=parts != "parity", parity_too=parts in ("both", "parity"),
            land=land.into if land is not None else None)
        if parts == "parity" and me == lost:
            os.replace(into, parity)
            rootdir.fsync_path(out)
        return got
    finally:
        sub.free()
