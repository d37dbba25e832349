"""The compressed shard's frames: HDF5 places and indexes each one, mpickpt writes its bytes.

Through :class:`mpickpt.format.framesink.FrameSink` HDF5 hands over the expected frame unwritten
(its offset noted), writes everything else itself, and the file the caller completes reads back
as the same tensors through h5py and through mpickpt's reader; a frame that cannot be written
fails the shard."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpickpt.format import framesink, reader, shard

hdf5plugin = pytest.importorskip("hdf5plugin")
pytest.importorskip("zstandard")
BLOCK = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3 * BLOCK // 4 + 77, generator=g)  # three chunks, the last one short
    b = torch.randint(0, 4, (2 * BLOCK + 5,), dtype=torch.uint8, generator=g)  # compressible
    return {"a": a, "b": b}


def _write(fd: int, frame: bytes, at: int) -> None:
    pool = framesink.AlignedBuffers(len(frame))
    buf = pool.take()
    buf[:len(frame)] = frame
    framesink.write_frame(fd, -1, buf, len(frame), at, pool)
    assert pool.take() is buf  # given back for the next frame


def test_the_expected_frame_is_handed_over_unwritten_and_the_rest_is_written(tmp_path: Path):
    path = tmp_path / "f.h5"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    sink = framesink.FrameSink(fd)
    frame = os.urandom(50_000)
    try:
        with h5py.File(sink, "w", libver=("v108", "v110")) as f:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk((len(frame),))
            ds = h5py.h5d.create(f.id, b"x", h5py.h5t.NATIVE_UINT8,
                                 h5py.h5s.create_simple((len(frame),)), dcpl=dcpl)
            sink.expect(frame)
            ds.write_direct_chunk((0,), frame)
            at = sink.taken()
            assert at is not None and at > 0
            assert sink.taken() is None  # once
            assert os.pread(fd, len(frame), at).strip(b"\0") == b""  # HDF5 wrote none of it
            _write(fd, frame, at)
            # armed for one buffer, another of the same length is written as HDF5 asks
            other = bytes(len(frame))
            sink.expect(frame)
            ds.write_direct_chunk((0,), other)
            assert sink.taken() is None
            assert ds.read_direct_chunk((0,))[1] == other
            sink.expect(frame)
            ds.write_direct_chunk((0,), frame)
            at = sink.taken()
            assert at is not None
            _write(fd, frame, at)
        with h5py.File(path, "r") as f:
            assert f["x"].id.read_direct_chunk((0,))[1] == frame
    finally:
        os.close(fd)


def test_a_compressed_shard_written_by_its_threads_reads_back_everywhere(tmp_path: Path):
    tensors = _state()
    codecs = {"a": "zstd", "b": "zstd+shuffle"}
    path = tmp_path / "s.h5"
    w = shard.ShardWriter(str(path), tensors, {"tree": "{}"}, codecs=codecs, block=BLOCK)
    assert isinstance(w._raw, framesink.FrameSink)
    w.write(tensors, block=BLOCK, threads=3)
    records = w.records
    size = w.seal()
    assert all(len(r.chunks) == -(-r.nbytes // BLOCK) for r in records)
    with h5py.File(path, "r") as f:
        for name, t in tensors.items():
            got = f[f"tensors/{name}"][()]
            assert np.array_equal(got, t.numpy()), name
    out = reader.read_shard(0, str(path), records, size, block=BLOCK, threads=2)
    for name, t in tensors.items():
        assert torch.equal(out[name], t), name


def test_a_frame_that_cannot_be_written_fails_the_shard(tmp_path: Path, monkeypatch):
    tensors = _state()

    def refuse(fd, dfd, buf, n, offset, pool):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(framesink, "write_frame", refuse)
    w = shard.ShardWriter(str(tmp_path / "s.h5"), tensors, {"tree": "{}"},
                          codecs={"a": "zstd", "b": "zstd"}, block=BLOCK)
    with pytest.raises(OSError, match="No space left"):
        w.write(tensors, block=BLOCK, threads=3)
    w.close()


def test_the_frame_buffers_are_kept_from_one_save_to_the_next(tmp_path: Path):
    """Compressed saves take their frame buffers from one pool the process keeps: three saves
    of 40 frames each map no more buffers than frames are ever in flight at once (a fresh
    64 MiB buffer per frame faulted its pages in, and unmapping it held the GIL)."""
    from mpickpt.format import codec

    block, threads = 3 << 18, 2  # a block size no other test uses: a pool of its own
    g = torch.Generator().manual_seed(4)
    tensors = {"w": torch.randint(0, 256, (40 * block,), dtype=torch.uint8, generator=g)}
    pool = framesink.buffers(codec.max_frame(block))
    assert pool.made == 0
    for k in range(3):
        w = shard.ShardWriter(str(tmp_path / f"s{k}.h5"), tensors, {"tree": "{}"},
                              codecs={"w": "zstd"}, block=block)
        w.write(tensors, block=block, threads=threads)
        w.seal()
        assert len(w.records[0].chunks) == 40
    # compressing ahead (2 x threads), being written (threads), one in hand: 120 frames in all
    assert 0 < pool.made <= 3 * threads + 1, pool.made
