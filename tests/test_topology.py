"""mpickpt/local/topology.py: nodes, redundancy sets and teams, partner rings, XOR chunks; and
the XOR of a block (local/xorring.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mpickpt.local import xordirect, xorring
from mpickpt.local.topology import (
    Topology,
    TopologyError,
    partner_holder,
    partner_source,
    xor_chunk,
    xor_chunk_bytes,
)


def nodes(*counts: int) -> Topology:
    return Topology(tuple(f"n{i}" for i, c in enumerate(counts) for _ in range(c)))


def test_partner_pairs_nodes_and_keeps_each_copy_on_another_node() -> None:
    t = nodes(2, 2, 2, 2)
    teams = t.teams("partner")
    assert teams == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for r in range(8):
        assert t.nodes[partner_holder(teams, r)] != t.nodes[r]
        assert partner_source(teams, partner_holder(teams, r)) == r


def test_an_odd_node_out_joins_the_last_set() -> None:
    t = nodes(1, 1, 1)
    assert t.teams("partner") == [[0, 1, 2]]
    assert [partner_holder([[0, 1, 2]], r) for r in range(3)] == [1, 2, 0]
    assert nodes(1, 1, 1, 1, 1).teams("xor", 2) == [[0, 1], [2, 3, 4]]


def test_xor_teams_take_one_rank_of_each_node_of_a_set() -> None:
    t = nodes(2, 2, 2)
    assert t.teams("xor", 3) == [[0, 2, 4], [1, 3, 5]]
    assert nodes(1, 1, 1, 1, 1, 1).teams("xor", 3) == [[0, 1, 2], [3, 4, 5]]


def test_nodes_are_ordered_by_their_lowest_rank_whatever_the_names() -> None:
    t = Topology(("b", "a", "b", "a"))
    assert t.names == ["b", "a"]
    assert t.teams("partner") == [[0, 1], [2, 3]]
    assert t.leader(2) == 0 and t.leader(3) == 1


def test_one_node_with_redundancy_is_refused_with_what_to_do() -> None:
    with pytest.raises(TopologyError, match=r"all 4 ranks run on one node.*redundancy=None"):
        nodes(4).teams("partner")


def test_uneven_nodes_are_refused_naming_the_counts() -> None:
    with pytest.raises(TopologyError, match="n0: 2, n1: 1"):
        nodes(2, 1).teams("xor")


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(TopologyError, match="redundancy must be"):
        nodes(1, 1).teams("mirror")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_xor_parity_rebuilds_any_one_member(n: int) -> None:
    """The chunk rule of the module docstring, worked through with numpy: the parities of a
    team and the other members' shards give back any one member's shard."""
    rng = np.random.default_rng(n)
    sizes = [int(s) for s in rng.integers(1, 5000, n)]
    shards = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    chunk = xor_chunk_bytes(max(sizes), n)

    def chunk_of(j: int, k: int) -> np.ndarray:
        c = np.zeros(chunk, dtype=np.uint8)
        start = xor_chunk(n, j, k) * chunk
        piece = shards[j][start:start + chunk]
        c[:len(piece)] = piece
        return c

    parity = [np.bitwise_xor.reduce([chunk_of(j, k) for j in range(n) if j != k])
              for k in range(n)]
    for lost in range(n):
        rebuilt = np.zeros(chunk * (n - 1), dtype=np.uint8)
        for k in range(n):
            if k == lost:
                continue
            got = parity[k].copy()
            for j in range(n):
                if j not in (k, lost):
                    got ^= chunk_of(j, k)
            start = xor_chunk(n, lost, k) * chunk
            rebuilt[start:start + chunk] = got
        assert np.array_equal(rebuilt[:sizes[lost]], shards[lost])


@pytest.mark.parametrize("team", [2, 3, 4, 8, 16, 64])
def test_direct_parity_blocks_keep_the_buffers_in_flight_within_the_exchanges(team: int) -> None:
    """A round of a team of ``team`` takes up to ``2 * team - 3`` buffers of a block, and up
    to AHEAD + 1 rounds are in flight: their blocks shrink with the team so that this stays
    within 1.5 times the exchange's BUFFERS blocks of 32 MiB (but never below 1 MiB); teams
    of 2 and 3 keep whole 32 MiB blocks (the size measured on an H200)."""
    block = xordirect.block_bytes(team, 32 << 20)
    assert block % 65536 == 0 and xordirect.MIN_BLOCK <= block <= xorring.BLOCK
    assert xordirect.block_bytes(team, 4 << 20) <= 4 << 20
    assert xordirect.block_bytes(team, 7000) == 7000  # a window below MIN_BLOCK is kept
    in_flight = (xordirect.AHEAD + 1) * (2 * team - 3) * block
    assert in_flight <= 1.5 * xorring.BUFFERS * xorring.BLOCK or block == xordirect.MIN_BLOCK
    if team <= 3:
        assert block == xorring.BLOCK


@pytest.mark.parametrize("n", [5, 8 << 10, (2 << 20) - 1, 2 << 20, (32 << 20) + 3])
@pytest.mark.parametrize("skew", [0, 3])
@pytest.mark.parametrize("threads", [xorring.XOR_THREADS, 1])
def test_xor_into_is_numpys_xor_in_pieces_or_whole(n: int, skew: int, threads: int) -> None:
    """xorring.xor_into: small blocks on this thread, large ones in pieces on its threads
    (unless told to use one), at addresses that are not whole words too; byte for byte
    numpy's XOR."""
    rng = np.random.default_rng(n + skew)
    acc = rng.integers(0, 256, n + skew, dtype=np.uint8)[skew:]
    src = rng.integers(0, 256, n + 1, dtype=np.uint8)[1:]
    want = acc ^ src
    xorring.xor_into(acc, src, threads)
    assert (acc == want).all()


# each rank prints its view of the nodes; MPI's processor name made to differ from the host
# name, as Open MPI's does on a host whose name has a domain
NAMES = ("import json, os; from mpi4py import MPI; "
         "MPI.Get_processor_name = lambda: 'short-name'; "
         "from mpickpt.mpi.protocol import Protocol; p = Protocol(); "
         "os.write(1, f'NODES {json.dumps(p.nodes(None))}\\n'.encode()); p.free()")


def test_a_node_is_named_after_its_host_under_any_backend() -> None:
    """A job that comes back under another launcher (mpirun, torchrun, alone) must find its
    node-local directory: every backend names a node after the host name (Open MPI's processor
    name drops the domain, so MPI's is not used)."""
    import json
    import re
    import socket

    from harness import run_mpi

    from mpickpt.mpi.protocol import Protocol

    alone = Protocol()
    try:
        assert alone.nodes(None) == [socket.gethostname()]
    finally:
        alone.free()
    job = run_mpi(2, ["-c", NAMES], timeout=120, warm=False)
    assert job.returncode == 0, job.stderr
    # (one write each: a pipe takes it whole)
    said = [json.loads(x) for x in re.findall(r"NODES (\[[^\]]*\])", job.stdout)]
    assert said == [[socket.gethostname()] * 2] * 2, job.stdout
