"""Declared sharded (mpickpt.Piece), replicated and per-rank tensors saved on N ranks and
restored on M: each rank gets exactly its new piece, reading only the byte ranges that hold it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import SCENARIOS, Job, manifest, run_mpi, step_dir

BLOCK = 4096  # small checksum blocks, so the byte ranges read can be told from whole records
SCENARIO = str(SCENARIOS / "reshard.py")


def job(n: int, mode: str, root: Path, reports: Path) -> dict[int, dict]:
    done = run_mpi(n, [SCENARIO, mode, str(root), str(reports), "--block", str(BLOCK)],
                   timeout=120)
    assert done.returncode == 0, done.output
    found = {r: json.loads((reports / f"{mode}-rank-{r}.json").read_text()) for r in range(n)}
    if mode == "restore" and "saved_by" in found[0] and found[0]["saved_by"] != n:
        # the per-rank tensors differ between the stored ranks: the r mod N rule matters
        assert "WARNING" in next(line for line in done.stderr.splitlines()
                                 if "are resharded; rank r takes the per-rank state" in line)
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One checkpoint per saving world size, made once."""
    base = tmp_path_factory.mktemp("reshard")
    out = {}
    for n in (1, 3, 4):
        root = base / f"n{n}"
        found = job(n, "save", root, base / f"save-{n}")
        assert all(r["committed"] for r in found.values()), found
        out[n] = root
    return out


def save_once(script: Path, n: int, root: Path, state: str, then: str, options: str = "") -> Job:
    """A program (written as ``script``) that saves ``state`` (an expression) as step 1 with a
    Checkpointer of ``options`` on ROOT ``root``, then runs ``then`` (``res`` is the result),
    run on ``n`` ranks."""
    script.write_text("import sys, torch, mpickpt\n"
                      f"ck = mpickpt.Checkpointer(sys.argv[1]{options})\n"
                      f"state = {state}\n"
                      "res = ck.save(1, state).wait()\n"
                      f"{then}\n"
                      "ck.close()\n")
    return run_mpi(n, [str(script), str(root)], timeout=120)


@pytest.mark.guarantee("reshard-bit-exact")
@pytest.mark.parametrize(("n", "m"), [pytest.param(3, 2, marks=pytest.mark.quick), (3, 3),
                                      (3, 1), (1, 4), (4, 3)],
                         ids=["3to2", "3to3", "3to1", "1to4", "4to3"])
def test_restore_on_another_number_of_ranks_gives_each_rank_its_new_piece(
        tmp_path, saved, n, m):
    found = job(m, "restore", saved[n], tmp_path / "rep")
    for r, rep in found.items():
        assert rep["step"] == 7 and rep["saved_by"] == n, rep
        assert rep["rows"] and rep["cols"] and rep["rep"], f"rank {r}: {rep}"
        assert rep["mine"], f"rank {r} did not get the per-rank tensor of rank {r % n}: {rep}"
        assert rep["note"] == f"saved by rank {r % n}", rep


def test_replicated_tensor_is_written_once_and_uneven_pieces_tile_the_whole(saved):
    m = manifest(saved[4], 7)
    records = [(e["rank"], t) for e in m["ranks"] for t in e["tensors"]]
    rep = [(r, t) for r, t in records if t["name"] == "rep"]
    assert len(rep) == 1, rep  # one copy, not four
    assert rep[0][1]["global_shape"] == [3, 5000] and rep[0][1]["offsets"] == [0, 0]
    rows = sorted((t["offsets"][0], t["shape"][0]) for _, t in records if t["name"] == "rows")
    assert [o for o, _ in rows] == [0] + [sum(s for _, s in rows[:i]) for i in range(1, 4)]
    assert sum(s for _, s in rows) == 37 and len({s for _, s in rows}) > 1  # uneven
    mine = [r for r, t in records if t["name"] == "mine"]
    assert mine == [0, 1, 2, 3] and all(t.get("global_shape") is None
                                        for _, t in records if t["name"] == "mine")
    # the tree of a rank that did not write "rep" still names it, as a sharded tensor
    for e in m["ranks"]:
        names = json.dumps(e["tree"], sort_keys=True)
        assert '{"device": "cpu", "name": "rep", "sharded": true' in names, e["rank"]


MANY_TOTAL = sum(4 * (1000 + 97 * i) for i in range(24))


@pytest.mark.parametrize("share, writers", [(0, 4), (MANY_TOTAL // 3, 3), (None, 1)],
                         ids=["spread", "three-writers", "default"])
def test_replicated_pieces_are_written_once_by_the_fewest_highest_ranks(tmp_path, share, writers):
    """Many replicated tensors: each is written once, and the bytes are shared out evenly over
    as many of the highest ranks as gives each ``min_write_share`` bytes (every rank with 0; the
    last alone for this 203 kB state with the default 16 MiB)."""
    root = tmp_path / "ck"
    files = "" if share is None else f", files=mpickpt.Files(min_write_share={share})"
    done = save_once(
        tmp_path / "many.py", 4, root,
        "{'model': {f'w{i}': torch.full((1000 + 97 * i,), float(i)) for i in range(24)}}",
        "assert res.committed", options=", replicated=('model',)" + files)
    assert done.returncode == 0, done.output
    m = manifest(root, 1)
    per_rank = [sum(t["nbytes"] for t in e["tensors"]) for e in m["ranks"]]
    names = [t["name"] for e in m["ranks"] for t in e["tensors"]]
    assert sorted(names) == sorted(f"model/w{i}" for i in range(24)), names
    assert sum(per_rank) == MANY_TOTAL
    assert per_rank[:4 - writers] == [0] * (4 - writers), per_rank  # rank 0 commits
    written = per_rank[4 - writers:]
    assert max(written) - min(written) <= 4 * (1000 + 97 * 23), per_rank  # within one tensor
    assert min(written) >= (share or 0) - 4 * (1000 + 97 * 23), per_rank
    # a rank that wrote no tensor has no file: its entry says so, and there is none
    assert [(e["file"], e["bytes"]) for e in m["ranks"][:4 - writers]] == [(None, 0)] * (
        4 - writers), m["ranks"]
    shards = sorted(p.name for p in step_dir(root, 1).iterdir() if p.suffix == ".h5")
    assert shards == [f"rank-{r:05d}.h5" for r in range(4 - writers, 4)], shards


@pytest.mark.guarantee("reshard-bit-exact")
def test_restore_reads_only_the_byte_ranges_it_needs(tmp_path, saved):
    """3 -> 2 ranks: each rank reads about the bytes of its own pieces (plus the replicated
    tensor), not the stored pieces whole, let alone every shard."""
    found = job(2, "restore", saved[3], tmp_path / "rep")
    records = [t for e in manifest(saved[3], 7)["ranks"] for t in e["tensors"]]
    sharded = sum(t["nbytes"] for t in records if t["name"] in ("rows", "cols"))
    for rep in found.values():
        # widening to checksum blocks: at most one block on each side of each stored piece
        # that overlaps (3 sharded pieces of each of 2 tensors, and the replicated one)
        slack = 2 * BLOCK * (3 * 2 + 1)
        assert rep["needed"] <= rep["bytes_read"] <= rep["needed"] + slack, rep
        # of the sharded tensors, a rank of two reads its part, not all of the pieces
        rep_and_mine = 3 * 5000 * 8 + 4 * 4
        assert rep["bytes_read"] - rep_and_mine < 0.75 * sharded, (rep, sharded)


def test_a_shard_layout_that_does_not_tile_the_tensor_aborts_the_save(tmp_path):
    """Two ranks claiming the same rows: the save is aborted on every rank before the commit."""
    root = tmp_path / "ck"
    done = save_once(
        tmp_path / "overlap.py", 2, root, "{'w': mpickpt.Piece(torch.ones(4, 2), (6, 2), (0, 0))}",
        "print('RESULT', ck.rank, res.committed, res.error, flush=True)")
    assert done.returncode == 0, done.output
    for r in range(2):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"RESULT {r} "))
        assert line.startswith(f"RESULT {r} False rank 0: commit failed: ValueError: tensor 'w'"), \
            done.output
    assert "the pieces of rank 0 ([4, 2] at [0, 0]) and rank 1 ([4, 2] at [0, 0]) overlap" \
        in done.stdout, done.output
    assert not step_dir(root, 1).exists()

