"""Where a restore from the node-local level gets each lost shard: a partner copy on another
node, else a rebuild by its XOR team, else nowhere (the step cannot be had from the level)."""

from __future__ import annotations

from typing import Any

from ..mpi.protocol import ranks_text
from .topology import partner_holder, team_of

Inventory = tuple[bool, list[int], list[int]]  # manifest there, shards there, parities there


def plan(nodes: list[str], lost: list[int], problems: list[str | None],
         inv: list[Inventory], layout: dict[str, Any]
         ) -> tuple[list[tuple[int, int]], dict[int, int], str | None]:
    """For the ``lost`` ranks (``problems[r]``: why), given what each rank's node holds
    (``inv``) and the redundancy ``layout`` the step was saved with: ((donor, receiver)
    copies, {team index: lost rank} XOR rebuilds, or why not)."""
    teams: list[list[int]] = layout.get("teams") or []
    scheme = layout.get("scheme")
    moves: list[tuple[int, int]] = []
    xor_lost: dict[int, int] = {}
    for r in lost:
        donors = [d for d in range(len(nodes))
                  if nodes[d] != nodes[r] and r in inv[d][1] and d not in lost]
        if scheme == "partner" and teams:  # the holder first: spread the load
            donors.sort(key=lambda d: d != partner_holder(teams, r))
        if donors:
            moves.append((donors[0], r))
            continue
        if scheme == "xor" and teams:
            team = team_of(teams, r)
            others = [m for m in team if m != r]
            if not any(m in lost for m in others) and all(m in inv[m][2] for m in others):
                xor_lost[teams.index(team)] = r
                continue
        return [], {}, (
            f"{ranks_text(lost)} cannot get their shards from the local level: rank {r}'s "
            f"{problems[r]}, and " + (
                "no other node holds a copy or a whole XOR team" if scheme else
                "it was saved without redundancy"))
    return moves, xor_lost, None


def receivers(moves: list[tuple[int, int]], xor_lost: dict[int, int]) -> set[int]:
    """The ranks that receive a rebuilt shard."""
    return {r for _, r in moves} | set(xor_lost.values())
