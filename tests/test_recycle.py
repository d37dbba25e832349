"""Recycled shard files in ROOT: retention moves a retired checkpoint's shards into ``ROOT/.pool``
and the next save writes over them instead of allocating fresh blocks (mpickpt.format.rootdir's
``retire`` and ``take``). What a recycled file held before never shows in what is read (only its
alignment padding may keep old bytes), and a file that is not plainly the job's own to write over
is left alone."""

from __future__ import annotations

import os
import stat

import h5py
import numpy as np
import pytest
import torch

import mpickpt
from mpickpt.format import rootdir

SHARD = "rank-00000.h5"


def state(k: float) -> dict[str, torch.Tensor]:
    """A state whose tensors span several checksum blocks, with an odd-sized one."""
    return {"w": torch.arange(3 << 18, dtype=torch.float32) + k,
            "b": torch.full((1001,), k, dtype=torch.float64), "n": torch.tensor(int(k))}


def save(ck: mpickpt.Checkpointer, step: int) -> mpickpt.SaveResult:
    result = ck.save(step, state(float(step))).wait()
    assert result.committed, result.error
    return result


def restored(root, step: int) -> dict[str, torch.Tensor]:
    got = {k: torch.zeros_like(v) for k, v in state(0.0).items()}
    with mpickpt.Checkpointer(root) as ck:
        assert ck.restore(got, step=step) == step
    return got


def shard(root, step: int) -> str:
    return os.path.join(root, rootdir.step_name(step), SHARD)


@pytest.mark.guarantee("flat-forever")
def test_a_retired_shard_is_written_over_by_the_next_save(tmp_path):
    """keep=2: the third save retires step 1's shard into the pool, the fourth writes over that
    very file (its inode; filled with garbage and made longer than it needs to be beforehand)
    and retires step 2's, and both the checkpoint and the shard read with h5py hold exactly the
    new step's bytes."""
    root = tmp_path / "ckpt"
    with mpickpt.Checkpointer(root, keep=2) as ck:
        save(ck, 1)
        first = os.stat(shard(root, 1))
        save(ck, 2)
        second = os.stat(shard(root, 2)).st_ino
        assert save(ck, 3).stats.get("recycled") == 0.0  # the pool was empty
        pooled = root / rootdir.POOL / SHARD
        assert sorted(os.listdir(root)) == [rootdir.POOL, "stats.jsonl", "step-00000002",
                                            "step-00000003"]
        assert os.listdir(root / rootdir.POOL) == [SHARD]
        assert os.stat(pooled).st_ino == first.st_ino
        with open(pooled, "r+b") as f:  # what it held must not show through
            f.write(b"\xff" * (2 * first.st_size))
        assert save(ck, 4).stats.get("recycled") == 1.0
    new = os.stat(shard(root, 4))
    assert new.st_ino == first.st_ino and new.st_size == first.st_size
    assert os.stat(pooled).st_ino == second  # save 4 retired step 2 in turn
    got, want = restored(root, 4), state(4.0)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with h5py.File(shard(root, 4), "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) == len(want)
        for k, v in want.items():
            found = [n for n in names if n.split("/")[-1] == k]
            assert len(found) == 1, (k, names)
            assert np.array_equal(f[found[0]][()], v.numpy())


@pytest.mark.guarantee("umask-honoured")
@pytest.mark.parametrize("planted", ["hard link", "symbolic link", "wider mode"])
def test_a_pooled_file_that_is_not_plainly_ours_is_not_written_over(tmp_path, planted):
    """A pooled shard that another name shares (a hard link: a user's backup), a link to
    elsewhere, or a file whose mode the umask would not give now is not taken: the save writes a
    new file, and the bytes elsewhere are untouched."""
    root = tmp_path / "ckpt"
    elsewhere = tmp_path / "backup.h5"
    with mpickpt.Checkpointer(root, keep=2) as ck:
        for step in (1, 2, 3):
            save(ck, step)
        pooled = root / rootdir.POOL / SHARD
        if planted == "hard link":
            os.link(pooled, elsewhere)
        elif planted == "symbolic link":
            os.replace(pooled, elsewhere)
            os.symlink(elsewhere, pooled)
        else:
            os.chmod(pooled, 0o666)
        before = elsewhere.read_bytes() if elsewhere.exists() else None
        assert save(ck, 4).stats.get("recycled") == 0.0
    st = os.lstat(shard(root, 4))
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert stat.S_IMODE(st.st_mode) & 0o002 == 0
    if before is not None:
        assert elsewhere.read_bytes() == before
    got, want = restored(root, 4), state(4.0)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_no_pool_where_saves_do_not_write_shards_whole(tmp_path):
    """Compressed shards are laid out anew at every save: their retired files are deleted."""
    pytest.importorskip("zstandard")
    root = tmp_path / "ckpt"
    with mpickpt.Checkpointer(root, keep=1,
                              encoding=mpickpt.Encoding(compression="zstd")) as ck:
        for step in (1, 2, 3):
            save(ck, step)
    assert sorted(os.listdir(root)) == ["stats.jsonl", "step-00000003"]


def test_retire_keeps_only_the_retired_shards_in_the_pool(tmp_path):
    """retire: a fanned-out shard keeps its sub-directory in the pool, what the pool held under
    other names (another world size's shards) goes, and nothing of the checkpoint is left."""
    step_dir, pool = tmp_path / "step-00000007", tmp_path / rootdir.POOL
    (step_dir / "shards-0001").mkdir(parents=True)
    (step_dir / "shards-0001" / "rank-01025.h5").write_bytes(b"a" * 100)
    (step_dir / "MANIFEST.json").write_text("{}")
    (pool / "shards-0003").mkdir(parents=True)
    (pool / "shards-0003" / "rank-03100.h5").write_bytes(b"old")
    rootdir.retire(str(step_dir), "run1", str(pool), lambda rel: rel.endswith(".h5"))
    kept = [os.path.relpath(os.path.join(d, f), pool) for d, _, fs in os.walk(pool) for f in fs]
    assert kept == ["shards-0001/rank-01025.h5"]
    assert sorted(os.listdir(tmp_path)) == [rootdir.POOL]
    taken = tmp_path / "taken.h5"
    assert rootdir.take(str(pool), "shards-0001/rank-01025.h5", str(taken))
    assert taken.read_bytes() == bytes(rootdir.SIGNATURE_BYTES) + b"a" * 92  # header wiped
    assert not rootdir.take(str(pool), "shards-0001/rank-01025.h5", str(taken))


def test_a_drain_to_root_writes_over_the_retired_shard(tmp_path):
    """With a node-local level, ROOT's checkpoints are drains (copies of the node's shards):
    the third drain with keep=2 writes over the shard ROOT's retention retired, and ROOT's
    copy loads exactly."""
    root = tmp_path / "root"
    local = mpickpt.Local(tmp_path / "local", persist_every=1)
    with mpickpt.Checkpointer(root, keep=2, local=local) as ck:
        inodes = []
        for step in (1, 2, 3, 4):
            save(ck, step)
            ck.wait()  # its drain
            assert ck.drained == step
            inodes.append(os.stat(shard(root, step)).st_ino)
    assert inodes[3] == inodes[0]  # step 1's file, retired by step 3's drain
    assert sorted(os.listdir(root)) == [rootdir.POOL, "stats.jsonl", "step-00000003",
                                        "step-00000004"]
    got = {k: torch.zeros_like(v) for k, v in state(0.0).items()}
    with mpickpt.Checkpointer(root) as ck:
        assert ck.restore(got, step=4) == 4
    want = state(4.0)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_recycled_file_cut_short_says_so_as_a_new_one_would(tmp_path):
    """A shard's HDF5 header is written last, so a crash diagnosis tells a finished shard from
    one whose writer died (mpickpt.cli.diagnose.shard_state). A recycled file holds a retired
    shard's sealed header: taking it wipes that, and a drain's copy over it writes the header
    last, so a copy cut short is "unsealed", not the retired checkpoint's "complete" shard."""
    from mpickpt.cli.diagnose import shard_state
    from mpickpt.format import shard as shardfile

    src = tmp_path / "src.h5"
    big = {"w": torch.arange(5 << 20, dtype=torch.int32), "b": torch.ones(7)}
    w = shardfile.ShardWriter(str(src), big, {"tree": "{}"})
    w.write(big)
    w.seal()
    pool = tmp_path / rootdir.POOL
    pool.mkdir()
    for name in ("a.h5", "b.h5"):
        (pool / name).write_bytes(src.read_bytes())  # a retired, sealed shard
        os.chmod(pool / name, rootdir.file_mode(str(pool / name)) & ~rootdir.umask())
    assert shard_state(str(pool / "a.h5")) == "complete"
    cut, whole = tmp_path / "cut.h5", tmp_path / "whole.h5"
    assert rootdir.take(str(pool), "a.h5", str(cut))
    assert shard_state(str(cut)) == "unsealed"

    def die(n: int) -> None:
        raise OSError("killed mid-copy")

    with pytest.raises(OSError, match="killed mid-copy"):
        rootdir.copy_file(str(src), str(cut), on_bytes=die, over=True)
    assert shard_state(str(cut)) == "unsealed"
    assert rootdir.take(str(pool), "b.h5", str(whole))
    assert rootdir.copy_file(str(src), str(whole), over=True) == src.stat().st_size
    assert shard_state(str(whole)) == "complete" and whole.read_bytes() == src.read_bytes()


@pytest.mark.quick
def test_the_umask_is_read_as_it_is_now_and_left_unchanged():
    """``take`` writes over a pooled file only if its mode is what a new file would get under
    the umask of that moment, which ``rootdir.umask`` reads from /proc without setting it."""
    before = os.umask(0o022)
    try:
        for mask in (0o022, 0o077, 0o000, 0o027, 0o777):
            os.umask(mask)
            assert rootdir.umask() == mask
            assert os.umask(mask) == mask  # reading it changed nothing
    finally:
        os.umask(before)


@pytest.mark.quick
def test_a_status_without_a_readable_umask_recycles_nothing():
    assert rootdir.parse_umask(b"Name:\tpython\nUmask:\t0027\nState:\tR\n") == 0o027
    assert rootdir.parse_umask(b"Name:\tpython\nUmask:\t0077") == 0o077  # the last line
    for status in (b"Name:\tpython\nState:\tR\n", b"Name:\tpython\nUmask:\t00z2\n",
                   b"Name:\tpython\nUmask:\n", b"Umask:\t0022\n", b""):
        assert rootdir.parse_umask(status) is None  # (the first line is always Name:)
