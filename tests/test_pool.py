"""The node-local level's recycled files (mpickpt.local.pool) and a shard written into one with
its HDF5 metadata laid out in memory (mpickpt.format.h5image): the file h5py, h5dump and our
reader see is the one a fresh file gives, whatever the recycled file held before."""

from __future__ import annotations

import os
import shutil
import subprocess

import h5py
import pytest
import torch

from mpickpt.format import h5image, reader, shard
from mpickpt.format.h5image import MetadataImage
from mpickpt.local import nodedir, pool

BLOCK = 1 << 16
pytestmark = pytest.mark.quick


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(600_000, generator=g),  # aligned, past the threshold
        "small": torch.randn(1000, generator=g),  # not aligned: beside the metadata
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4),
        "grp/nested": torch.arange(10, dtype=torch.int64) + seed,
    }


def write_into(maps: pool.Maps, pool_dir: str, directory: str, state: dict[str, torch.Tensor],
               codecs: dict[str, str] | None = None) -> tuple[shard.ShardWriter, int]:
    into = maps.take(pool_dir, directory, "rank-00000.h5")
    w = shard.ShardWriter(os.path.join(directory, "rank-00000.h5"), state, {"tree": "{}"},
                          alignment=1 << 18, into=into, codecs=codecs, block=BLOCK)
    w.write(state, block=BLOCK, threads=3)
    return w, w.seal()


def assert_reads_back(path: str, w: shard.ShardWriter, size: int,
                      state: dict[str, torch.Tensor], h5py_data: bool = True) -> None:
    """Our reader gets every tensor back; h5py the attributes (and the data, unless compressed:
    h5py needs a plugin for zstd)."""
    assert os.path.getsize(path) == size
    out = reader.read_shard(0, path, w.records, size, block=BLOCK, threads=3)
    for k, t in state.items():
        assert torch.equal(out[k].view(t.dtype).reshape(t.shape), t), k
    with h5py.File(path, "r") as f:
        assert f.attrs["tree"] == "{}"
        big = f["tensors/big"]
        assert big.attrs["torch_dtype"] == "float32"
        if h5py_data:
            assert torch.equal(torch.from_numpy(big[...]), state["big"])


def test_a_recycled_file_written_over_reads_back_as_a_fresh_one(tmp_path):
    """Three saves through one name: the second and third write over the first's file (the
    same inode, still mapped), a damaged pool file included: garbage over every byte, and
    another time cut short; each reads back exact through our reader and h5py."""
    maps, pool_dir = pool.Maps(), str(tmp_path / nodedir.POOL)
    inodes = []
    for step, damage in enumerate([None, "garbage", "short"]):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        state = tensors(step)
        w, size = write_into(maps, pool_dir, str(d), state)
        path = str(d / "rank-00000.h5")
        inodes.append(os.stat(path).st_ino)
        assert_reads_back(path, w, size, state)
        nodedir.retire(str(d), pool_dir, "test")
        assert not d.exists() and os.listdir(pool_dir) == ["rank-00000.h5"]
        pooled = os.path.join(pool_dir, "rank-00000.h5")
        if damage == "garbage" or step == 0:
            with open(pooled, "r+b") as f:
                f.write(os.urandom(size))
        if damage == "short" or step == 1:
            os.truncate(pooled, size // 3)
    assert inodes[0] == inodes[1] == inodes[2], "the retired file was not written over"
    maps.close()


def test_a_recycled_files_padding_is_zeros_as_in_a_fresh_file(tmp_path):
    """A shard written over a recycled file full of other bytes is byte for byte the file the
    same save writes into a fresh one: its alignment padding too is zeros (the XOR parity,
    made from the tensors and the metadata alone, is rebuilt from the files)."""
    maps, pool_dir, state = pool.Maps(), str(tmp_path / nodedir.POOL), tensors(3)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    w, size = write_into(maps, pool_dir, str(fresh), state)
    want = (fresh / "rank-00000.h5").read_bytes()
    gaps = h5image.padding(size, [(r.offset, r.nbytes) for r in w.records])
    assert sum(n for _, n in gaps) > BLOCK, "no padding: the test would show nothing"
    nodedir.retire(str(fresh), pool_dir, "test")
    with open(os.path.join(pool_dir, "rank-00000.h5"), "r+b") as f:
        f.write(b"\xa5" * (2 * size))
    again = tmp_path / "again"
    again.mkdir()
    write_into(maps, pool_dir, str(again), state)
    assert (again / "rank-00000.h5").read_bytes() == want
    maps.close()


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="no h5dump")
def test_h5dump_reads_a_shard_written_into_a_destination(tmp_path):
    maps = pool.Maps()
    write_into(maps, str(tmp_path / nodedir.POOL), str(tmp_path), tensors(1))
    out = subprocess.run(["h5dump", "-H", str(tmp_path / "rank-00000.h5")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tensors" in out.stdout and "xxh3_64" in out.stdout
    maps.close()


def test_compressed_records_go_through_the_metadata_image(tmp_path):
    pytest.importorskip("zstandard")
    maps, state = pool.Maps(), tensors(2)
    state["big"] = torch.zeros(600_000)  # compressible
    w, size = write_into(maps, str(tmp_path / nodedir.POOL), str(tmp_path), state,
                         codecs={"big": "zstd"})
    assert size < 600_000 * 4
    assert_reads_back(str(tmp_path / "rank-00000.h5"), w, size, state, h5py_data=False)
    maps.close()


def test_the_image_gives_back_every_byte_but_the_data_ranges():
    img = MetadataImage()
    img.seek(0)
    img.write(b"A" * 10)
    img.seek(100)
    img.write(b"B" * 50)  # 120..130 will be data: HDF5 wrote there before allocating it
    img.seek(5000)
    img.write(b"C" * 5)
    img.truncate(6000)
    got = list(img.extents([(120, 10), (5002, 1)]))
    assert got == [(0, b"A" * 10), (100, b"B" * 20), (130, b"B" * 20), (5000, b"CC"),
                   (5003, b"CC")]
    img.seek(98)
    buf = bytearray(6)
    assert img.readinto(buf) == 6 and bytes(buf) == b"\0\0BBBB"


def test_a_deleted_file_is_let_go_and_a_new_one_made(tmp_path):
    maps, pool_dir = pool.Maps(), str(tmp_path / nodedir.POOL)
    first = maps.take(pool_dir, str(tmp_path), "rank-00000.h5")
    first.reserve(1 << 16)[:] = 7
    os.unlink(tmp_path / "rank-00000.h5")
    again = maps.take(pool_dir, str(tmp_path), "rank-00000.h5")
    assert again is not first and os.fstat(again.fd).st_nlink == 1
    assert int(again.reserve(1 << 16).sum()) == 0
    maps.close()
