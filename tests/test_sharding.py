"""The arithmetic of pieces: overlaps, byte spans, in-place reads, writer choice, tiling."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mpickpt import Piece, sharding
from mpickpt.format.shard import TensorRecord
from mpickpt.restore.reshard import Target


def test_overlap_of_boxes():
    assert sharding.overlap((0, 0), (4, 6), (2, 3), (5, 5)) == ((2, 3), (2, 3))
    assert sharding.overlap((0,), (4,), (4,), (3,)) is None  # touching is not overlapping
    assert sharding.overlap((), (), (), ()) == ((), ())  # 0-d tensors
    assert sharding.overlap((0, 0), (0, 5), (0, 0), (3, 5)) is None  # empty piece


def test_flat_span_covers_exactly_the_rows_of_a_row_box_and_spans_a_column_box():
    # rows 2..4 of a (10, 8) piece: elements 16..32, nothing more
    assert sharding.flat_span((10, 8), (2, 0), (2, 8)) == (16, 32)
    # columns 3..5 of rows 1..3: from (1, 3) to (2, 4) inclusive
    assert sharding.flat_span((10, 8), (1, 3), (2, 2)) == (11, 21)
    t = torch.arange(80).reshape(10, 8)
    first, end = sharding.flat_span((10, 8), (1, 3), (2, 2))
    span = t.reshape(-1)[first:end]
    assert set(t[1:3, 3:5].reshape(-1).tolist()) <= set(span.tolist())


@pytest.mark.parametrize(("box_off", "box", "expect"), [
    ((3, 0), (2, 8), 3 * 8 * 4),  # whole rows: contiguous
    ((3, 2), (1, 4), (3 * 8 + 2) * 4),  # part of one row: contiguous
    ((3, 2), (2, 4), None),  # a column band: not contiguous
    ((0, 0), (10, 8), 0),  # everything
])
def test_a_whole_record_is_read_in_place_only_when_contiguous_in_the_target(box_off, box, expect):
    t = Target("w", "float32", (20, 8), (0, 0), (10, 8))
    rec = TensorRecord("w", "float32", list(box), 0, math.prod(box) * 4, [], [20, 8],
                       list(box_off))
    assert t.in_place(rec, box_off, box) == expect


def test_a_partial_overlap_is_never_read_in_place():
    t = Target("w", "float32", (20, 8), (0, 0), (10, 8))
    rec = TensorRecord("w", "float32", [6, 8], 0, 6 * 8 * 4, [], [20, 8], [8, 0])
    assert t.in_place(rec, (8, 0), (2, 8)) is None


def test_writers_spread_bytes_evenly_and_agree_whatever_the_order():
    pieces = [(f"w{i}", 100 + 10 * i, (0, 1, 2, 3)) for i in range(20)]
    a = sharding.writers(pieces)
    b = sharding.writers(list(reversed(pieces)))
    assert a == b
    load = [sum(n for name, n, _ in pieces if a[name] == r) for r in range(4)]
    assert max(load) - min(load) <= 290, load
    only = sharding.writers([("x", 5, (2, 5))])
    assert only == {"x": 2}


def test_a_share_gives_a_small_group_to_its_fewest_highest_holders():
    """``share``: as many writers as give each ``share`` bytes (at least one, at most every
    holder), the highest ranks, the bytes spread evenly over them; each group apart."""
    pieces = [(f"w{i}", 100, (0, 1, 2, 3)) for i in range(20)]  # 2,000 bytes
    pieces += [(f"v{i}", 100, range(8, 14, 2)) for i in range(6)]  # 600 bytes on 8, 10, 12
    for share, four, three in [(0, {0, 1, 2, 3}, {8, 10, 12}), (1, {0, 1, 2, 3}, {8, 10, 12}),
                               (600, {1, 2, 3}, {12}), (1000, {2, 3}, {12}),
                               (1 << 30, {3}, {12})]:
        got = sharding.writers(pieces, share)
        assert got == sharding.writers(list(reversed(pieces)), share)  # every holder agrees
        assert {got[f"w{i}"] for i in range(20)} == four, share
        assert {got[f"v{i}"] for i in range(6)} == three, share
        load = [sum(100 for i in range(20) if got[f"w{i}"] == r) for r in sorted(four)]
        assert max(load) - min(load) <= 100 and min(load) >= min(share, 2000) // 2, (share, load)
    # a world of holders stays a range: 10 writers of 100,000 ranks, the last ten
    many = sharding.writers([(f"t{i}", 10, range(100_000)) for i in range(2000)], 2000)
    assert set(many.values()) == set(range(99_990, 100_000))


def test_the_writers_of_the_same_pieces_are_kept_and_other_pieces_get_their_own():
    """A training loop saves the same pieces every time: their writers are worked out once
    (the same answer, not sorted again); a piece of another size is a new question."""
    t = {f"w{i}": torch.zeros(10 + i) for i in range(6)}
    placements = {n: sharding.whole(tuple(x.shape), 4) for n, x in t.items()}
    first = sharding.writers_of(t, placements)
    assert sharding.writers_of(dict(t), dict(placements)) is first
    assert first == sharding.writers((n, x.nbytes, range(4)) for n, x in t.items())
    t["w0"] = torch.zeros(1000)
    placements["w0"] = sharding.whole((1000,), 4)
    other = sharding.writers_of(t, placements)
    assert other == sharding.writers((n, x.nbytes, range(4)) for n, x in t.items())
    assert other != first  # the largest piece goes first, to rank 0


def test_writers_pick_as_the_plain_rule_does_and_a_world_of_holders_is_a_range():
    """The heap gives what "each piece, largest first, to the holder with the fewest bytes,
    the lowest rank among equals" gives, for any holders; replicated tensors of a world of
    100,000 ranks carry range(100000), not a tuple per tensor."""
    def plain(pieces):
        load, out = {}, {}
        for name, nbytes, holders in sorted(pieces, key=lambda p: (-p[1], p[0])):
            rank = min(holders, key=lambda r: (load.get(r, 0), r))
            load[rank] = load.get(rank, 0) + nbytes
            out[name] = rank
        return out

    rng = random.Random(3)
    for holders in [(0, 1, 2, 3), (1, 4, 9), range(0, 12, 3), range(7)]:
        pieces = [(f"t{i}", rng.choice([0, 8, 8, 100, 4096]), holders) for i in range(40)]
        assert sharding.writers(pieces) == plain(pieces)
    p = sharding.placement_of(torch.zeros(3), "w", True, 100_000)
    assert p is not None and p.holders == range(100_000)
    many = [(f"t{i}", 10 + i % 7, range(100_000)) for i in range(2000)]
    got = sharding.writers(many)
    assert sorted(got.values()) == list(range(2000))  # 2000 pieces, 2000 different writers
    assert sharding.compact([2, 5, 8]) == range(2, 9, 3)
    assert sharding.compact([1, 2, 4]) == (1, 2, 4)


def test_coverage_refuses_gaps_overlaps_and_disagreements():
    ok = {"w": [(0, (6, 2), (0, 0), (4, 2), "float32"), (1, (6, 2), (4, 0), (2, 2), "float32")]}
    sharding.check_coverage(ok)
    gap = {"w": [(0, (6, 2), (0, 0), (4, 2), "float32")]}
    with pytest.raises(ValueError, match="hold 8 of its 12 elements"):
        sharding.check_coverage(gap)
    twice = {"w": [(0, (6, 2), (0, 0), (3, 2), "float32"), (1, (6, 2), (0, 0), (3, 2), "float32")]}
    with pytest.raises(ValueError, match=r"rank 0 \(\[3, 2\] at \[0, 0\]\) and rank 1 .* overlap"):
        sharding.check_coverage(twice)
    # sizes that add up, but [0, 60) and [40, 80) overlap and [80, 100) is missing
    shifted = {"v": [(0, (100,), (0,), (60,), "int8"), (1, (100,), (40,), (40,), "int8")]}
    with pytest.raises(ValueError, match="overlap"):
        sharding.check_coverage(shifted)


def test_first_overlap_sweeps_rows_and_ignores_empty_pieces():
    rows = [((i * 4, 0), (4, 8)) for i in range(50)]
    assert sharding.first_overlap(rows) is None
    assert sharding.first_overlap([*rows, ((10, 2), (1, 1))]) == (2, 50)
    grid = [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    assert sharding.first_overlap(grid) is None
    assert sharding.first_overlap([((0, 0), (0, 5)), ((0, 0), (2, 2))]) is None
    other = {"w": [(0, (6, 2), (0, 0), (3, 2), "float32"), (1, (6, 2), (3, 0), (3, 2), "int64")]}
    with pytest.raises(ValueError, match="rank 1 holds a piece of int64"):
        sharding.check_coverage(other)


def test_shard_declaration_is_checked():
    with pytest.raises(ValueError, match="does not lie within"):
        Piece(torch.zeros(4, 2), (5, 2), (2, 0))
    with pytest.raises(ValueError, match="differ in rank"):
        Piece(torch.zeros(4, 2), (8,), (0,))
    with pytest.raises(ValueError, match="needs global_shape and offsets"):
        Piece(torch.zeros(2))
    r = Piece(torch.zeros(3), replicated=True)
    assert r.global_shape == (3,) and r.offsets == (0,)


def test_dtensor_placements_on_a_one_rank_mesh(tmp_path):
    """Shard and Replicate placements on a real (one-rank, gloo) device mesh."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    from torch.distributed.tensor import Shard as TShard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(6, 2)
        sharded = sharding.dtensor_placement(distribute_tensor(full, mesh, [TShard(0)]), "w")
        assert sharded == sharding.Placement((6, 2), (0, 0), (6, 2), None)
        rep = distribute_tensor(full, mesh, [Replicate()])
        assert sharding.dtensor_placement(rep, "w").holders == (0,)
        assert sharding.dtensor_placement(rep, "w").holders == (0,)  # from the cache
        assert sharding._replica_group.cache_info().hits >= 1
    finally:
        dist.destroy_process_group()
