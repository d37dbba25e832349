"""Compressed checkpoints in one process: every dtype round-trips bit for bit, h5py (with
hdf5plugin) reads the shard as the same tensors, damage in a compressed chunk is found and named,
hostile chunk lists are refused before anything is read, and compression combines with
incremental checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import h5py
import pytest
import torch
import xxhash

import mpickpt
from mpickpt.cli import EXIT_OK
from mpickpt.cli import main as cli_main
from mpickpt.errors import ShardError
from mpickpt.format import dtypes
from mpickpt.format.manifest import CHECKSUM_FIELD, Manifest, read_bytes
from mpickpt.format.records import DTYPES, check_records

hdf5plugin = pytest.importorskip("hdf5plugin")
BLOCK = 16384


def every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of each dtype mpickpt stores, of several blocks, with structure and noise; its
    bit patterns are random where the dtype allows (NaNs and infinities included)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in DTYPES:
        dt = dtypes.torch_dtype(name)
        n = (5 * BLOCK + 123) // dtypes.itemsize(name)  # over codec.MIN_BYTES
        raw = torch.randint(0, 256, (n * dtypes.itemsize(name),), dtype=torch.uint8, generator=g)
        raw[: raw.numel() // 2] = 0  # half zeros: compressible
        out[name] = raw.view(dt) if dt != torch.bool else raw.remainder(2).bool()
    out["float32_2d"] = torch.randn(97, 301, generator=g)
    return out


def save(root: Path, state: dict, **kw) -> mpickpt.SaveResult:
    files = mpickpt.Files(checksum_block=BLOCK, alignment=4096)
    with mpickpt.Checkpointer(root, files=files, encoding=mpickpt.Encoding(**kw)) as ck:
        return ck.save(1, state).wait()


def load(root: Path, like: dict) -> tuple[int | None, dict, mpickpt.RestoreInfo]:
    fresh = {k: torch.zeros_like(v) for k, v in like.items()}
    with mpickpt.Checkpointer(root) as ck:
        got = ck.restore(fresh)
        assert ck.restore_info is not None
        return got, fresh, ck.restore_info


def manifest(root: Path, step: int = 1) -> Manifest:
    d = root / f"step-{step:08d}"
    return Manifest.from_json(read_bytes(str(d)), str(d / "MANIFEST.json"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle"])
def test_every_dtype_round_trips_bit_for_bit(tmp_path: Path, codec: str):
    state = every_dtype()
    r = save(tmp_path, state, compression=codec)
    assert r.committed, r.error
    m = manifest(tmp_path)
    assert m.version == 3 and {t.codec for t in m.ranks[0].tensors} == {codec}
    got, fresh, _ = load(tmp_path, state)
    assert got == 1
    for k, v in state.items():
        assert same_bits(fresh[k], v), k
    raw = sum(v.numel() * v.element_size() for v in state.values())
    assert r.stats["bytes"] < 0.8 * raw, (r.stats["bytes"], raw)  # the zeros compress


def test_h5py_reads_the_compressed_shard_as_the_same_tensors(tmp_path: Path):
    state = {"w": torch.randn(200, 333), "h": torch.randn(5000).half(), "n": torch.arange(9)}
    assert save(tmp_path, state, compression="zstd+shuffle").committed
    with h5py.File(tmp_path / "step-00000001" / "rank-00000.h5", "r") as f:
        for name, t in state.items():
            ds = f[f"tensors/{name}"]
            arr = ds[()]
            assert list(ds.attrs["shape"]) == list(t.shape) and ds.attrs["torch_dtype"] == \
                dtypes.name_of(t.dtype)
            assert torch.equal(torch.from_numpy(arr.reshape(tuple(t.shape))), t), name
        assert f["tensors/w"].compression_opts is not None or f["tensors/w"].chunks
    code, doc = _verify(tmp_path)
    assert code == EXIT_OK, doc


def _verify(root: Path) -> tuple[int, dict]:
    """``mpickpt verify ROOT --verify full --json`` in this process: (exit code, report)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main.main(["verify", str(root), "--verify", "full", "--json"])
    return code, json.loads(out.getvalue())


@pytest.mark.guarantee("damage-detected")
def test_damage_in_a_compressed_chunk_is_found_and_named(tmp_path: Path):
    torch.manual_seed(1)
    state = {"w": torch.randn(300, 300)}
    assert save(tmp_path, state, compression="zstd").committed
    rec = manifest(tmp_path).ranks[0].tensors[0]
    at, size = rec.chunks[2]
    shard = tmp_path / "step-00000001" / "rank-00000.h5"
    with open(shard, "r+b") as f:
        f.seek(at + size // 2)
        b = f.read(1)
        f.seek(at + size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    got, fresh, info = load(tmp_path, state)
    assert got is None and torch.count_nonzero(fresh["w"]) == 0
    (_, why), = info.skipped
    assert str(shard) in why and "tensor 'w'" in why and "block 2 (compressed" in why, why
    code, doc = _verify(tmp_path)
    assert code != EXIT_OK and "block 2 (compressed" in json.dumps(doc), doc


@pytest.mark.parametrize(("edit", "why"), [
    (lambda t: t.update(chunks=t["chunks"][:-1]), "compressed chunks recorded for"),
    (lambda t: t["chunks"][0].__setitem__(0, 1 << 40), "lie outside the"),
    (lambda t: t["chunks"][1].__setitem__(0, t["chunks"][0][0]), "overlap"),
    (lambda t: t["chunks"][0].__setitem__(1, 1 << 30), r"is not \[offset, bytes\] of a frame"),
    (lambda t: t.update(codec="gzip"), "unknown codec 'gzip'"),
])
@pytest.mark.guarantee("damage-detected")
def test_hostile_chunk_lists_are_refused_before_anything_is_read(tmp_path: Path, edit, why):
    torch.manual_seed(2)
    assert save(tmp_path, {"w": torch.randn(100, 200)}, compression="zstd").committed
    path = tmp_path / "step-00000001" / "MANIFEST.json"
    d = json.loads(path.read_text())
    edit(d["ranks"][0]["tensors"][0])
    body = {k: v for k, v in d.items() if k != CHECKSUM_FIELD}
    d[CHECKSUM_FIELD] = xxhash.xxh3_64_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    m = Manifest.from_json(json.dumps(d), str(path))
    e = m.ranks[0]
    with pytest.raises(ShardError, match=why):
        check_records(0, "shard", e.tensors, e.bytes, m.checksum_block)


def test_compression_by_key_path_and_small_tensors_stay_raw(tmp_path: Path):
    state = {"model": {"w": torch.zeros(64, 1024), "b": torch.zeros(16)},
             "optim": {"m": torch.zeros(64, 1024)}, "emb": torch.zeros(64, 1024)}
    assert save(tmp_path, state, compression={"model": "zstd", "optim": "zstd+shuffle",
                                              "emb": None}).committed
    codecs = {t.name: t.codec for t in manifest(tmp_path).ranks[0].tensors}
    assert codecs == {"model/w": "zstd", "model/b": None, "optim/m": "zstd+shuffle",
                      "emb": None}


def test_compressed_and_incremental_together(tmp_path: Path):
    frozen = torch.randn(256, 256)
    with mpickpt.Checkpointer(tmp_path, files=mpickpt.Files(checksum_block=BLOCK),
                              encoding=mpickpt.Encoding(incremental=4, compression="zstd")) as ck:
        for s in (1, 2, 3):
            r = ck.save(s, {"frozen": frozen, "step": torch.full((20000,), float(s))}).wait()
            assert r.committed
    m = manifest(tmp_path, 3)
    recs = {t.name: t for t in m.ranks[0].tensors}
    assert recs["frozen"].source == "step-00000001/rank-00000.h5" and recs["frozen"].codec
    assert recs["step"].source is None and recs["step"].codec == "zstd"
    got, fresh, _ = load(tmp_path, {"frozen": frozen, "step": torch.zeros(20000)})
    assert got == 3 and torch.equal(fresh["frozen"], frozen)
    assert torch.equal(fresh["step"], torch.full((20000,), 3.0))


def test_options_that_cannot_work_are_refused_at_once(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown codec 'lz5'"):
        mpickpt.Checkpointer(tmp_path / "r", encoding=mpickpt.Encoding(compression="lz5"))
    with pytest.raises(ValueError, match="unknown codec"):
        mpickpt.Checkpointer(tmp_path / "r",
                             encoding=mpickpt.Encoding(compression={"model": "gzip"}))
    with pytest.raises(ValueError, match="compression is written to ROOT only"):
        mpickpt.Checkpointer(tmp_path / "r", local=tmp_path / "local",
                             encoding=mpickpt.Encoding(compression="zstd"))


def test_a_chunk_is_one_checksum_block_or_the_whole_smaller_tensor():
    from mpickpt.format import codec

    assert codec.chunk_elements(10 * BLOCK, 4, BLOCK) == BLOCK // 4
    assert codec.chunk_elements(100, 4, BLOCK) == 25


def test_one_thread_reads_frames_of_every_size_through_its_reused_buffers(tmp_path: Path):
    """A reading thread keeps its buffers for a file's compressed chunks (a fresh zeroed one per
    chunk held the GIL: docs/performance.md); frames of very different sizes, read one after
    another by one thread, each decompress to their own bytes, into the tensor or through a
    buffer smaller than a block."""
    from mpickpt.format import blocks, reader

    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (9 * BLOCK,), dtype=torch.uint8, generator=g)
    for b in range(0, 9, 2):  # blocks 0, 2, 4, 6, 8 all zeros: frames of a few bytes between
        w[b * BLOCK:(b + 1) * BLOCK] = 0  # others of about a block
    state = {"w": w, "z": torch.zeros(3 * BLOCK, dtype=torch.uint8)}
    assert save(tmp_path, state, compression="zstd").committed
    m = manifest(tmp_path)
    records = m.ranks[0].tensors
    sizes = [c[1] for r in records if r.name == "w" for c in r.chunks]
    assert min(sizes) < BLOCK // 100 and max(sizes) > BLOCK // 2, sizes
    path = str(tmp_path / "step-00000001" / "rank-00000.h5")
    out = reader.read_shard(0, path, records, m.ranks[0].bytes, block=BLOCK, threads=1)
    for k, v in state.items():
        assert same_bits(out[k], v), k
    blocks.verify_file(0, path, m.ranks[0].bytes, records, BLOCK, threads=1)
    small = memoryview(bytearray(BLOCK // 4))  # smaller than a block: through the thread's own
    with blocks.BlockFile(0, path, m.ranks[0].bytes, BLOCK) as f:
        r = next(r for r in records if r.name == "w")
        for n in (1, 0, 3, 2):
            assert f.read_block(r, n, small) == BLOCK


@pytest.fixture(params=["libzstd", "zstandard"])
def compressor(request, monkeypatch) -> str:
    """Compression through zstd's own library, or through ``zstandard`` where it is missing."""
    from mpickpt.format import zstdlib

    if request.param == "libzstd" and zstdlib.lib() is None:
        pytest.skip("libzstd.so.1 is not on this machine")
    if request.param == "zstandard":
        monkeypatch.setattr(zstdlib, "lib", lambda: None)
    return request.param


@pytest.mark.quick
@pytest.mark.parametrize("name", ["zstd", "zstd+shuffle"])
@pytest.mark.parametrize("size", [BLOCK, BLOCK - 4 * 37, 4])
def test_a_block_compresses_into_the_callers_buffer_as_hdf5_reads_it(compressor, name, size):
    """A block's frame, written into the caller's buffer by either compressor, is what HDF5's
    pipeline reads: one zstd frame recording its content size, of the block zero-padded to the
    chunk (and byte-shuffled); and it decompresses back to the block's own bytes."""
    import numpy as np
    import zstandard

    from mpickpt.format import codec

    g = np.random.default_rng(size)
    raw = g.integers(0, 256, size, dtype=np.uint8)
    raw[: size // 2] = 0
    out = memoryview(bytearray(codec.max_frame(BLOCK)))
    n = codec.compress_into(name, memoryview(raw), BLOCK, 4, out)
    frame = bytes(out[:n])
    want = np.concatenate([raw, np.zeros(BLOCK - size, np.uint8)])
    if name == "zstd+shuffle":
        want = want.reshape(-1, 4).T.reshape(-1)
    assert zstandard.ZstdDecompressor().decompress(frame) == want.tobytes()
    back = memoryview(bytearray(size))
    codec.decompress(name, frame, back, BLOCK, 4)
    assert bytes(back) == raw.tobytes()
    if compressor == "libzstd":
        assert codec.compress(name, memoryview(raw), BLOCK, 4) == frame


@pytest.mark.quick
def test_zstds_library_is_found_past_what_is_not_it(monkeypatch):
    """The loader takes the first candidate that is zstd 1.4 or newer: a library without zstd's
    functions and a path that does not exist are passed over, and with nothing left the
    ``zstandard`` API serves (the round-trip tests above run both ways)."""
    from mpickpt.format import zstdlib

    real = zstdlib.candidates()
    assert real[-1] == "libzstd.so.1"
    monkeypatch.setattr(zstdlib, "candidates", lambda: ["libc.so.6", "/nonexistent/libz.so"])
    assert zstdlib._load() is None
    monkeypatch.setattr(zstdlib, "candidates", lambda: ["libc.so.6", *real])
    z = zstdlib._load()
    if z is None:
        pytest.skip("neither zstandard's copy of zstd nor libzstd.so.1 loads here")
    assert z.ZSTD_versionNumber() >= zstdlib.MIN_VERSION
