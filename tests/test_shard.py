"""mpickpt.format.shard: layout with h5py, positional writes, verification on read."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import stat
import subprocess
import threading
import weakref

import h5py
import numpy as np
import pytest
import torch
from harness import never_blocks

from mpickpt.errors import ShardError
from mpickpt.format import blocks, reader, shard

BLOCK = 1 << 16


def write(path, tensors, alignment=1 << 20):
    w = shard.ShardWriter(str(path), tensors, {"tree": "{}"}, alignment=alignment)
    w.write(tensors, block=BLOCK, threads=3)
    return w.records, w.seal()


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300_000, generator=g),
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "grp/nested": torch.arange(10, dtype=torch.int64),
        "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
    }


def test_large_tensors_are_aligned_and_h5py_reads_them(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    by = {r.name: r for r in records}
    assert by["big"].offset % (1 << 20) == 0
    assert len(by["big"].checksums) == -(-by["big"].nbytes // BLOCK)
    with h5py.File(tmp_path / "s.h5") as f:
        np.testing.assert_array_equal(f["tensors/big"][:], tensors["big"].numpy())
        np.testing.assert_array_equal(f["tensors/grp/nested"][:], np.arange(10))
        assert f["tensors/bf16"].attrs["torch_dtype"] == "bfloat16"
        raw = torch.from_numpy(f["tensors/bf16"][:]).view(torch.bfloat16)
        assert torch.equal(raw, tensors["bf16"])
        assert f["tensors/scalar"][()] == 2.5
        assert f["tensors/big"].attrs["xxh3_64"] == ",".join(by["big"].checksums)
    assert size == (tmp_path / "s.h5").stat().st_size


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) not installed")
def test_h5dump_reads_the_shard(tmp_path, tensors):
    write(tmp_path / "s.h5", tensors)
    out = subprocess.run(["h5dump", "-d", "/tensors/grp/nested", str(tmp_path / "s.h5")],
                         capture_output=True, text=True, check=True).stdout
    assert "0, 1, 2, 3, 4, 5, 6, 7, 8, 9" in out


def test_read_back_is_bit_exact(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    out = reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=BLOCK, threads=3)
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_flipped_byte_names_file_tensor_and_block(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    big = next(r for r in records if r.name == "big")
    with open(tmp_path / "s.h5", "r+b") as f:
        f.seek(big.offset + 3 * BLOCK + 5)
        b = f.read(1)
        f.seek(big.offset + 3 * BLOCK + 5)
        f.write(bytes([b[0] ^ 0x40]))
    msg = r"rank 3: .*s\.h5: tensor 'big': checksum mismatch in block 3"
    with pytest.raises(ShardError, match=msg):
        reader.read_shard(3, str(tmp_path / "s.h5"), records, size, block=BLOCK)


def small_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {f"t{i}": torch.randn(1 + 37 * i, generator=g) for i in range(300)}  # up to 44 KB
    out["edge"] = torch.randn(reader.SMALL_SPAN // 4, generator=g)  # the largest read in runs
    out["over"] = torch.randn(reader.SMALL_SPAN // 4 + 1, generator=g)  # read alone
    out["empty"] = torch.empty(0)
    return out


@pytest.mark.parametrize("run_bytes", [reader.RUN_BYTES, 16 << 10])
def test_small_tensors_read_in_runs_are_bit_exact(tmp_path, monkeypatch, run_bytes):
    """Spans of SMALL_SPAN bytes or fewer are read a run at a time and each block checked in
    memory; runs of at most RUN_BYTES (here also 16 KiB: many runs)."""
    monkeypatch.setattr(reader, "RUN_BYTES", run_bytes)
    tensors = small_tensors()
    w = shard.ShardWriter(str(tmp_path / "s.h5"), tensors, {"tree": "{}"}, alignment=1 << 20,
                          block=4096)
    w.write(tensors, block=4096, threads=3)
    records, size = w.records, w.seal()
    spans = [reader.Span(r, 0, r.nbytes, torch.empty(r.nbytes, dtype=torch.uint8))
             for r in records]
    assert len(reader._runs(spans, list(range(len(spans) - 1)))) > (run_bytes < 1 << 20)
    out = reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=4096, threads=3)
    for k, t in tensors.items():
        assert torch.equal(out[k].view(torch.uint8), t.view(torch.uint8)), k


def test_a_flipped_byte_in_a_run_names_the_tensor_and_its_block(tmp_path):
    tensors = small_tensors()
    w = shard.ShardWriter(str(tmp_path / "s.h5"), tensors, {"tree": "{}"}, alignment=1 << 20,
                          block=4096)
    w.write(tensors, block=4096, threads=3)
    records, size = w.records, w.seal()
    rec = next(r for r in records if r.name == "t250")  # 9,254 floats: 10 blocks
    with open(tmp_path / "s.h5", "r+b") as f:
        f.seek(rec.offset + 7 * 4096 + 11)
        b = f.read(1)
        f.seek(rec.offset + 7 * 4096 + 11)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ShardError, match=r"rank 2: .*s\.h5: tensor 't250': checksum mismatch "
                                         r"in block 7"):
        reader.read_shard(2, str(tmp_path / "s.h5"), records, size, block=4096)
    empty = next(r for r in records if r.name == "empty")
    fresh = shard.ShardWriter(str(tmp_path / "e.h5"), {"empty": torch.empty(0)}, {"tree": "{}"},
                              alignment=1 << 20, block=4096)
    fresh.write({"empty": torch.empty(0)}, block=4096)
    [lying], esize = fresh.records, fresh.seal()
    lying.checksums = ["0" * len(empty.checksums[0])]  # an empty block's checksum is checked
    with pytest.raises(ShardError, match=r"tensor 'empty': checksum mismatch in block 0"):
        reader.read_shard(0, str(tmp_path / "e.h5"), [lying], esize, block=4096)


def test_received_spans_are_verified_where_they_landed(tmp_path, tensors):
    """verify_spans (a lost node's bytes, received over MPI): blocks 2..5 of 'big' as read are
    intact; one flipped bit names the file they came from, the sender, the tensor and the
    block; a span that is not whole checksum blocks is refused."""
    records, size = write(tmp_path / "s.h5", tensors)
    big = next(r for r in records if r.name == "big")
    got = reader.read_shard(3, str(tmp_path / "s.h5"), records, size, block=BLOCK)["big"]
    raw = got.reshape(-1).view(torch.uint8)
    span = reader.Span(big, 2 * BLOCK, 6 * BLOCK, raw[2 * BLOCK:6 * BLOCK].clone())
    reader.verify_spans(3, str(tmp_path / "s.h5"), [span], block=BLOCK, threads=3)
    span.dest[BLOCK + 7] ^= 0x01  # block 3 of the record
    msg = (r"rank 3: .*s\.h5: tensor 'big': checksum mismatch in block 3 \(bytes \d+\.\.\d+\)"
           r" as rank 1 sent it")
    with pytest.raises(ShardError, match=msg):
        reader.verify_spans(3, str(tmp_path / "s.h5"), [span], block=BLOCK, threads=3,
                            how=" as rank 1 sent it")
    odd = reader.Span(big, BLOCK + 1, 2 * BLOCK, raw[BLOCK + 1:2 * BLOCK].clone())
    with pytest.raises(ValueError, match="whole checksum blocks"):
        reader.verify_spans(3, str(tmp_path / "s.h5"), [odd], block=BLOCK)


def _maps_of(path: str) -> int:
    """How many of this process's memory maps are of ``path``."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(" " + real) for line in f)


def _unmappers_done() -> None:
    for t in threading.enumerate():
        if t.name == "mpickpt-unmap":
            t.join(10)
            assert not t.is_alive()


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_mapped_shard_is_let_go_behind_the_caller_unless_a_view_is_held(tmp_path, tensors,
                                                                          monkeypatch):
    """let_go_behind (the end of a restore from a node's own shards in memory): the views
    handed to it dropped and the map closed, its pages let go piece by piece, on a thread of
    its own; the file is no longer mapped. A view held elsewhere keeps its map, which goes
    with it."""
    from mpickpt.format import pages

    records, size = write(tmp_path / "s.h5", tensors)
    path = str(tmp_path / "s.h5")
    big = next(r for r in records if r.name == "big")
    unmapped_on: list[str] = []
    real = pages.unmap

    def spy(m, *a):
        unmapped_on.append(threading.current_thread().name)
        real(m, *a)

    monkeypatch.setattr(pages, "unmap", spy)
    m = reader.MappedSpans(3, path, size, [(big, 0, big.nbytes)], block=BLOCK)
    m.verify(threads=2)
    got = torch.frombuffer(m.views[0], dtype=torch.float32)
    assert torch.equal(got, tensors["big"])
    assert _maps_of(path) == 1
    reader.let_go_behind([got], [m])
    del got
    _unmappers_done()
    assert unmapped_on == ["mpickpt-unmap"]
    assert _maps_of(path) == 0

    m = reader.MappedSpans(3, path, size, [(big, 0, big.nbytes)], block=BLOCK)
    kept = torch.frombuffer(m.views[0], dtype=torch.float32)
    reader.let_go_behind([], [m])
    del m
    _unmappers_done()
    assert _maps_of(path) == 1 and torch.equal(kept, tensors["big"])
    del kept
    gc.collect()
    assert _maps_of(path) == 0


def test_truncated_file_is_refused_by_size(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    with open(tmp_path / "s.h5", "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ShardError, match="truncated"):
        reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=BLOCK)


def test_lying_records_never_allocate_beyond_the_file(tmp_path, tensors):
    _, size = write(tmp_path / "s.h5", tensors)
    liar = shard.TensorRecord("huge", "float32", [1 << 40], 0, 4 << 40, ["0"])
    with pytest.raises(ShardError, match="outside"):
        reader.read_shard(0, str(tmp_path / "s.h5"), [liar], size, block=BLOCK)
    wrong = shard.TensorRecord("x", "float32", [10], 0, 8, ["0"])
    with pytest.raises(ShardError, match="needs 40"):
        reader.read_shard(0, str(tmp_path / "s.h5"), [wrong], size, block=BLOCK)
    odd = shard.TensorRecord("x", "pickle", [1], 0, 1, ["0"])
    with pytest.raises(ShardError, match="unknown dtype"):
        reader.read_shard(0, str(tmp_path / "s.h5"), [odd], size, block=BLOCK)


def test_symlinked_shard_is_refused(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    (tmp_path / "link.h5").symlink_to(tmp_path / "s.h5")
    with pytest.raises(ShardError, match="cannot open"):
        reader.read_shard(0, str(tmp_path / "link.h5"), records, size, block=BLOCK)


def test_page_aligned_buffers_take_the_direct_path_and_stay_bit_exact(tmp_path):
    from mpickpt.save.pinned_pool import HostPool

    pool = HostPool(64 << 20, slots=2)
    src = pool.acquire(16 << 20)
    assert src.data_ptr() % blocks.DIRECT_ALIGN == 0
    g = torch.Generator().manual_seed(1)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=g))
    # an odd-sized tensor at the start of the buffer: its whole pages go O_DIRECT, its tail not
    # (over shard.INLINE_BYTES in all: a smaller shard goes through the page cache)
    tensors = {"odd": src[: (5 << 20) + 100], "tiny": src[8 << 20 : (8 << 20) + 7]}
    fd = blocks._open_direct(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT)
    if fd < 0:
        pytest.skip("this file system has no O_DIRECT")
    os.close(fd)
    assert blocks._direct_len(0, src.data_ptr(), 1 << 20, (5 << 20) + 100) == 5 << 20
    records, size = write(tmp_path / "s.h5", tensors)
    dst = pool.acquire(16 << 20)
    out = reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=BLOCK, threads=3,
                           buffer=lambda n: dst[:n])
    for k, t in tensors.items():
        assert torch.equal(out[k], t), k


def _mapping(ptr: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping of this process that holds address ``ptr``."""
    with open("/proc/self/smaps") as f:
        found = None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= ptr < hi else None
            elif found and head == "VmFlags:":
                return found[0], found[1], line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _huge_mapping(buf) -> bool:
    """Whether ``buf`` is the whole of its own storage (a mapping made for it, not a slice of a
    larger allocation) and lies in memory advised to use huge pages (``hg``; adjacent mappings
    with the same flags merge, so the flags are those of the mapping holding it)."""
    _, hi, flags = _mapping(buf.data_ptr())
    return (buf.untyped_storage().nbytes() == buf.numel() and hi >= buf.data_ptr() + buf.numel()
            and "hg" in flags)


def _plain(buf) -> bool:
    """Whether ``buf`` is a page-aligned slice of an ordinary allocation (``torch.empty``)."""
    from mpickpt.save.pinned_pool import ALIGN

    return buf.untyped_storage().nbytes() == buf.numel() + ALIGN


def test_large_buffers_of_a_page_locking_pool_ask_for_huge_pages_the_others_do_not():
    from mpickpt.save import pinned_pool

    if not pinned_pool.huge_pages_on_request():
        pytest.skip("this kernel gives no transparent huge pages on request")
    big = pinned_pool.host_buffer(8 << 20, huge=True)
    small = pinned_pool.host_buffer(64 << 10, huge=True)
    plain = pinned_pool.host_buffer(8 << 20)
    for b, n in ((big, 8 << 20), (small, 64 << 10), (plain, 8 << 20)):
        assert b.numel() == n and b.data_ptr() % blocks.DIRECT_ALIGN == 0
    assert _huge_mapping(big) and not _plain(big)  # MADV_HUGEPAGE on a mapping of its own
    assert _plain(small) and _plain(plain)
    assert _huge_mapping(pinned_pool.HostPool(64 << 20, pin=True)._new(8 << 20))
    assert _plain(pinned_pool.HostPool(64 << 20, pin=False)._new(8 << 20))
    big.fill_(7)
    view = big[100:200]
    del big  # the view keeps the mapping
    assert int(view.sum()) == 700


def test_spans_into_another_device_are_read_and_verified_in_page_locked_buffers(tmp_path, tensors):
    """A restore into GPU memory (here the meta device, which any machine has): every block
    read into a page-locked buffer of a Bounce, verified there, the buffer given back after it;
    without one, refused; a flipped byte is named as on the host path; the buffers are let go
    at close."""
    from mpickpt.restore.device_room import Bounce

    records, size = write(tmp_path / "s.h5", tensors)
    big = next(r for r in records if r.name == "big")
    span = reader.Span(big, 0, big.nbytes, torch.empty(big.nbytes, dtype=torch.uint8,
                                                       device="meta"))
    with pytest.raises(ValueError, match="page-locked"):
        reader.read_spans(0, str(tmp_path / "s.h5"), size, [span], block=BLOCK, threads=3)
    bounce = Bounce(BLOCK, 3, pin=False)
    seen: set[int] = set()

    @contextlib.contextmanager
    def counted():
        with bounce() as buf:
            seen.add(buf.data_ptr())
            yield buf

    reader.read_spans(0, str(tmp_path / "s.h5"), size, [span], block=BLOCK, threads=3,
                      bounce=counted)
    assert 1 <= len(seen) <= 3  # at most a buffer per thread, each used again
    assert bounce._pool.allocated_bytes == len(seen) * BLOCK
    assert bounce._pool.in_flight() == 0  # every block gave its buffer back
    with open(tmp_path / "s.h5", "r+b") as f:
        f.seek(big.offset + 2 * BLOCK + 9)
        b = f.read(1)
        f.seek(big.offset + 2 * BLOCK + 9)
        f.write(bytes([b[0] ^ 0x04]))
    with pytest.raises(ShardError, match=r"rank 5: .*s\.h5: tensor 'big': checksum mismatch "
                                         r"in block 2"):
        reader.read_spans(5, str(tmp_path / "s.h5"), size, [span], block=BLOCK, threads=3,
                          bounce=bounce)
    assert bounce._pool.in_flight() == 0  # also where a block failed
    taken = [weakref.ref(t) for t in bounce._pool._allocated]
    bounce.close()
    assert bounce._pool.allocated_bytes == 0
    gc.collect()
    assert taken and not any(t() is not None for t in taken), "a buffer outlived close()"


def test_a_one_block_file_read_on_the_calling_thread_then_many_blocks_never_wait_forever(
        tmp_path, tensors):
    """A file of one block is read on the calling thread (one task), the next on all the I/O
    threads: one more thread than the Bounce has buffers. Each block gives its buffer back,
    so the last thread waits for one at most (a buffer kept per thread hung here)."""
    from mpickpt.restore.device_room import Bounce

    records, size = write(tmp_path / "s.h5", tensors)
    big = next(r for r in records if r.name == "big")
    one = reader.Span(big, 0, BLOCK, torch.empty(BLOCK, dtype=torch.uint8, device="meta"))
    many = reader.Span(big, 0, big.nbytes, torch.empty(big.nbytes, dtype=torch.uint8,
                                                       device="meta"))
    bounce = Bounce(BLOCK, 2, pin=False)
    pool, stuck = bounce._pool, threading.Event()

    def unstick() -> None:  # had a block waited forever: every buffer back, so that it ends
        stuck.set()
        for buf in [b for b in pool._allocated if not any(b is f for f in pool._free)]:
            pool.release(buf)

    timer = threading.Timer(20, unstick)
    timer.start()
    try:
        reader.read_spans(0, str(tmp_path / "s.h5"), size, [one], block=BLOCK, threads=2,
                          bounce=bounce)
        reader.read_spans(0, str(tmp_path / "s.h5"), size, [many], block=BLOCK, threads=2,
                          bounce=bounce)
    finally:
        timer.cancel()
    assert not stuck.is_set(), "a block waited for a buffer that no thread would give back"
    assert pool.in_flight() == 0 and pool.allocated_bytes <= 2 * BLOCK
    bounce.close()


# ------------------------------------------------------------- hostile records and files


def _records(tmp_path, tensors):
    records, size = write(tmp_path / "s.h5", tensors)
    return {r.name: r for r in records}, size


def test_overlapping_records_are_refused(tmp_path, tensors):
    by, size = _records(tmp_path, tensors)
    by["bf16"].offset = by["big"].offset + 4
    with pytest.raises(ShardError, match=r"tensor 'bf16': bytes .* overlap those of tensor 'big'"):
        shard.check_records(0, "s.h5", list(by.values()), size, BLOCK)


def test_a_name_recorded_twice_is_refused(tmp_path, tensors):
    by, size = _records(tmp_path, tensors)
    twin = shard.TensorRecord(**{**by["scalar"].__dict__, "offset": by["scalar"].offset})
    with pytest.raises(ShardError, match="tensor 'scalar': recorded twice"):
        shard.check_records(0, "s.h5", [*by.values(), twin], size, BLOCK)


@pytest.mark.parametrize("shape", [[1 << 63, 0], [-1, 0], [1] * 65])
def test_impossible_shapes_are_refused(tmp_path, tensors, shape):
    by, size = _records(tmp_path, tensors)
    by["empty"].shape = shape
    with pytest.raises(ShardError, match="impossible shape"):
        shard.check_records(0, "s.h5", list(by.values()), size, BLOCK)


def test_a_file_of_another_size_is_refused_before_anything_is_allocated(tmp_path, tensors):
    """The manifest claims a larger file and records that fit the claim: read_shard refuses on
    the real size before it asks for a buffer."""
    _, size = _records(tmp_path, tensors)
    huge = 1 << 40
    liar = shard.TensorRecord("huge", "float32", [(huge - (1 << 20)) // 4], 1 << 20,
                              huge - (1 << 20), ["0"] * (-(-(huge - (1 << 20)) // BLOCK)))
    asked = []
    with pytest.raises(ShardError, match=f"size is {size} bytes, the manifest says {huge}"):
        reader.read_shard(0, str(tmp_path / "s.h5"), [liar], huge, block=BLOCK,
                         buffer=lambda n: asked.append(n) or torch.empty(0, dtype=torch.uint8))
    assert asked == []


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_shard_that_is_not_a_regular_file_is_refused_at_once(tmp_path, tensors, kind):
    """A FIFO would block the reader forever in open(); a directory or link is no shard."""
    by, size = _records(tmp_path, tensors)
    path = tmp_path / "odd.h5"
    {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir,
     "symlink": lambda: path.symlink_to(tmp_path / "s.h5")}[kind]()
    said = {"fifo": "it is a FIFO", "directory": "it is a directory",
            "symlink": "it is a symbolic link"}[kind]
    with never_blocks("the reader"), pytest.raises(ShardError, match=f"cannot open: {said}"):
        reader.read_shard(0, str(path), list(by.values()), size, block=BLOCK)


@pytest.mark.guarantee("umask-honoured")
def test_the_writer_never_makes_a_world_writable_shard(tmp_path, tensors):
    old = os.umask(0)
    try:
        write(tmp_path / "s.h5", tensors)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s.h5").stat().st_mode) == 0o664


def test_attributes_are_what_h5py_writes(tmp_path):
    """The shard's attributes, written through HDF5's low-level API, read back through h5py
    exactly as ``attrs[name] = value`` would have made them: same values, types and shapes."""
    import h5py
    import numpy as np

    from mpickpt.format.h5layout import dataset_path as _dataset_path
    from mpickpt.format.shard import ShardWriter

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "s": torch.tensor(7)}
    path = str(tmp_path / "x.h5")
    w = ShardWriter(path, tensors, {"rank": 3, "tree": '{"é": 1}'})
    w.write(tensors)
    w.seal()
    with h5py.File(path) as f, h5py.File(tmp_path / "ref.h5", "w") as ref:
        ref.attrs["rank"], ref.attrs["tree"] = 3, '{"é": 1}'
        d = ref.create_dataset("d", (1,), "f4")
        d.attrs["torch_dtype"], d.attrs["shape"] = "float32", np.asarray((2, 3), dtype=np.int64)
        d.attrs["scalar_shape"] = np.asarray((), dtype=np.int64)
        for name in ("rank", "tree"):
            assert f.attrs.get_id(name).get_type() == ref.attrs.get_id(name).get_type()
            assert f.attrs[name] == ref.attrs[name]
        ds = f[_dataset_path("a")]
        assert ds.attrs["torch_dtype"] == "float32"
        assert ds.attrs.get_id("torch_dtype").get_type() == d.attrs.get_id("torch_dtype").get_type()
        assert list(ds.attrs["shape"]) == [2, 3]
        assert ds.attrs.get_id("shape").get_type() == d.attrs.get_id("shape").get_type()
        assert len(ds.attrs["xxh3_64"].split(",")) == 1
        assert f.attrs["mpickpt_version"] >= 1


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="a fake tensor on cuda:1 initializes that device where CUDA is real: "
                           "it needs no GPU, or two")
def test_a_tensor_the_state_lacks_goes_onto_the_gpu_it_was_saved_from_if_the_state_uses_it():
    """A restarted job's fresh optimizer has no tensors to say where its state goes: each
    one saved from a GPU goes onto that GPU where the state has tensors on it, else onto the
    GPU holding most of the state; one saved from the CPU stays there. (Fake CUDA tensors:
    no GPU needed to plan.)"""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mpickpt.format.records import TensorRecord
    from mpickpt.restore import reshard

    with FakeTensorMode(allow_non_fake_inputs=True):
        live = {"model/a": torch.empty(4, device="cuda:0"),
                "model/b": torch.empty(4, device="cuda:0"),
                "model/big": torch.empty(1 << 10, device="cuda:1")}
    names = {n: str(t.device) for n, t in live.items()}
    names |= {"optim/state/2/exp_avg": "cuda:1", "optim/state/0/exp_avg": "cuda:0",
              "ema/shadow": "cuda:3", "optim/state/0/step": "cpu"}
    own, off = {}, 0
    for n in names:
        k = live[n].numel() if n in live else 1 << 10
        own[n] = TensorRecord(n, "float32", [k], off, 4 * k)
        off += 4 * k
    entry = SimpleNamespace(tree={}, tensors=[])
    manifest = SimpleNamespace(ranks=[entry], checksum_block=1 << 20)
    p = reshard._plan(manifest, 0, names, own, {0: entry}, live, {}, "here")
    assert p.fresh == {"optim/state/2/exp_avg", "optim/state/0/exp_avg", "ema/shadow"}
    assert p.devices["optim/state/2/exp_avg"] == torch.device("cuda:1")
    assert p.devices["optim/state/0/exp_avg"] == torch.device("cuda:0")
    assert p.devices["ema/shadow"] == torch.device("cuda:0")  # (no tensor of the state there)
    assert "optim/state/0/step" not in p.devices

