"""mpickpt/format/commit.py, the one commit: what a published checkpoint looks like on disk, what a
commit stopped half-way leaves, and the presence check before it (real files, no MPI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpickpt.format import commit, rootdir
from mpickpt.format.entry import RankEntry
from mpickpt.format.manifest import NAME as MANIFEST


class Stop(Exception):
    pass


def entry(rank: int, file: str | None, nbytes: int) -> RankEntry:
    return RankEntry(rank=rank, file=file, bytes=nbytes, tensors=[], tree={})


def partial_with(root: Path, step: int, files: dict[str, int]) -> Path:
    partial = root / rootdir.partial_name(step, "r1")
    partial.mkdir(parents=True)
    for name, size in files.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(b"x" * size)
    return partial


def refuse(path: str) -> None:
    raise Stop(path)


def test_publish_writes_the_side_files_then_the_manifest_and_renames_into_place(tmp_path):
    partial = partial_with(tmp_path, 20, {"rank-00000.h5": 10})
    final = commit.publish(str(tmp_path), str(partial), 20, b'{"m": 1}',
                           side=[("LEVEL.json", b"{}")], existing=refuse)
    assert final == str(tmp_path / "step-00000020")
    assert not partial.exists()
    assert sorted(os.listdir(final)) == sorted([MANIFEST, "LEVEL.json", "rank-00000.h5"])
    assert (Path(final) / MANIFEST).read_bytes() == b'{"m": 1}'
    assert [s for s, _ in rootdir.committed(str(tmp_path))] == [20]


def test_a_commit_stopped_mid_manifest_leaves_nothing_committed(tmp_path):
    partial = partial_with(tmp_path, 20, {"rank-00000.h5": 10})

    def half() -> None:
        raise Stop("half")

    with pytest.raises(Stop):
        commit.publish(str(tmp_path), str(partial), 20, b"x" * 100, existing=refuse,
                       on_half=half)
    assert partial.exists() and not (partial / MANIFEST).exists()
    assert [p.name for p in partial.iterdir()] == ["rank-00000.h5"]  # no temp file left
    assert rootdir.committed(str(tmp_path)) == []


def test_a_step_already_there_goes_to_existing_which_may_refuse_or_replace(tmp_path):
    old = partial_with(tmp_path, 20, {"rank-00000.h5": 1})
    commit.publish(str(tmp_path), str(old), 20, b"old", existing=refuse)
    again = partial_with(tmp_path, 20, {"rank-00000.h5": 2})
    with pytest.raises(Stop, match="step-00000020"):
        commit.publish(str(tmp_path), str(again), 20, b"new", existing=refuse)
    assert (tmp_path / "step-00000020" / MANIFEST).read_bytes() == b"old"  # kept as it was
    assert again.exists()  # the caller discards it
    commit.publish(str(tmp_path), str(again), 20, b"new",
                   existing=lambda final: rootdir.remove(final, "r1"))
    assert (tmp_path / "step-00000020" / MANIFEST).read_bytes() == b"new"
    assert (tmp_path / "step-00000020" / "rank-00000.h5").stat().st_size == 2


def test_presence_names_missing_and_wrong_sized_shards_in_sub_directories_too(tmp_path):
    partial = partial_with(tmp_path, 30, {"rank-00000.h5": 8, "shards-0001/rank-00002.h5": 5,
                                          "rank-00003.h5": 4})
    ranks = [entry(0, "rank-00000.h5", 8), entry(1, "rank-00001.h5", 8),
             entry(2, "shards-0001/rank-00002.h5", 5), entry(3, "rank-00003.h5", 9)]
    found = commit.presence(str(partial), ranks)
    assert (found.missing, found.wrong_size, found.complete) == ([1], [3], False)
    whole = commit.presence(str(partial), [ranks[0], ranks[2]])
    assert whole.complete
    # a rank that wrote no tensor has no file, and none is looked for
    assert commit.presence(str(partial), [ranks[0], entry(1, None, 0), ranks[2]]).complete


def test_a_link_in_place_of_a_shard_is_not_a_shard(tmp_path):
    partial = partial_with(tmp_path, 30, {})
    target = tmp_path / "elsewhere.h5"
    target.write_bytes(b"y" * 8)
    (partial / "rank-00000.h5").symlink_to(target)
    assert commit.presence(str(partial), [entry(0, "rank-00000.h5", 8)]).missing == [0]
