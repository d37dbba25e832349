"""Which rank runs on which node, and who protects whose shard in the node-local level.

Pure functions of the list of node names, one per rank (:meth:`Protocol.nodes` finds it:
MPI's shared-memory split, or ``$MPICKPT_NODE`` where a test or an odd launcher sets it).

Redundancy sets, the rules in one place:

* Nodes are numbered in order of their lowest rank; ranks of a node in rank order (the local
  index). Every node must have as many ranks as the others.
* The nodes are cut into consecutive *sets* of ``set_size`` nodes (2 for ``partner``); a last
  set smaller than 2 joins the one before it (SCR does the same).
* A *team* is the ranks of one local index on the nodes of one set: each on another node.
* ``partner``: every rank's shard is also stored by the next rank of its team (a ring: node
  ``k`` of a set holds the copies of node ``k-1``). Survives the loss of one node per set.
* ``xor``: the shards of a team are cut into ``len(team) - 1`` chunks of ``L`` bytes each (zero
  padded; ``L = ceil(largest / (len - 1))``); the member at team position ``k`` stores parity
  ``P_k``, the XOR over the other members ``j`` of their chunk for ``k`` (member ``j``'s chunks
  go to the positions other than ``j``, in order). ``1 / (len - 1)`` extra space; survives the
  loss of one node per set.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import SCHEMES

DEFAULT_XOR_SET = 4  # nodes per XOR set (SCR's default is 8; smaller sets survive more losses)


class TopologyError(ValueError):
    """Ranks that cannot be protected as asked."""


@dataclass(frozen=True)
class Topology:
    """The node of every rank (``nodes[r]`` is rank r's node name)."""

    nodes: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        """The node names, in order of their lowest rank."""
        return list(dict.fromkeys(self.nodes))

    def ranks_of(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def node_index(self, rank: int) -> int:
        return self.names.index(self.nodes[rank])

    def local_index(self, rank: int) -> int:
        return self.ranks_of(self.nodes[rank]).index(rank)

    def leader(self, rank: int) -> int:
        """The lowest rank of ``rank``'s node (it writes the node's shared files)."""
        return self.ranks_of(self.nodes[rank])[0]

    def node_sets(self, set_size: int) -> list[list[str]]:
        names = self.names
        sets = [names[i:i + set_size] for i in range(0, len(names), set_size)]
        if len(sets) > 1 and len(sets[-1]) < 2:
            sets[-2].extend(sets.pop())
        return sets

    def teams(self, scheme: str, set_size: int | None = None) -> list[list[int]]:
        """The redundancy teams (lists of ranks, each on another node), checked."""
        if scheme not in SCHEMES:
            raise TopologyError(f"redundancy must be one of {SCHEMES} or None, not {scheme!r}")
        size = 2 if scheme == "partner" else (set_size or DEFAULT_XOR_SET)
        names = self.names
        if size < 2:
            raise TopologyError(f"a redundancy set needs at least 2 nodes, not {size}")
        if len(names) < 2:
            raise TopologyError(
                f"redundancy={scheme!r} stores a copy of each shard on another node, and all "
                f"{len(self.nodes)} ranks run on one node ({names[0]}): losing it would lose "
                "every copy. Use redundancy=None on one node (the local level then survives a "
                "restart of the job, not the loss of the node), or run on 2 nodes or more "
                "(MPICKPT_NODE simulates nodes in tests)")
        per_node = {n: len(self.ranks_of(n)) for n in names}
        if len(set(per_node.values())) > 1:
            counts = ", ".join(f"{n}: {c}" for n, c in per_node.items())
            raise TopologyError(
                f"redundancy={scheme!r} needs the same number of ranks on every node; this job "
                f"has {counts}")
        out = []
        for nodes in self.node_sets(size):
            for i in range(per_node[names[0]]):
                out.append([self.ranks_of(n)[i] for n in nodes])
        return out


def team_of(teams: list[list[int]], rank: int) -> list[int]:
    return next(t for t in teams if rank in t)


def partner_holder(teams: list[list[int]], rank: int) -> int:
    """The rank that stores ``rank``'s partner copy: the next one in its team."""
    team = team_of(teams, rank)
    return team[(team.index(rank) + 1) % len(team)]


def partner_source(teams: list[list[int]], rank: int) -> int:
    """The rank whose partner copy ``rank`` stores: the previous one in its team."""
    team = team_of(teams, rank)
    return team[(team.index(rank) - 1) % len(team)]


def xor_chunk(team_size: int, member: int, position: int) -> int:
    """Which of member ``member``'s chunks goes into parity ``position`` (``!= member``)."""
    assert position != member
    return position if position < member else position - 1


def xor_chunk_bytes(largest: int, team_size: int) -> int:
    """``L``: the bytes of one chunk and of one parity file."""
    return -(-largest // (team_size - 1)) if largest else 0
