"""mpickpt.save.landing: a shard's blocks written while its bytes are still landing in host memory.

On a GPU the persist thread empties the snapshot's staging buffer into the host buffer piece by
piece while the I/O threads write the blocks that have landed. Here the host buffer is filled by
hand, piece by piece, over garbage: what the shard holds (and its checksums) must be the landed
bytes, never the garbage before them, and a landing that fails must fail the write, not hang it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from harness import never_blocks

from mpickpt.errors import CheckpointError
from mpickpt.format import hostcopy, reader, shard
from mpickpt.format.hostcopy import copy_all, host_copy
from mpickpt.local.pool import Maps
from mpickpt.save.landing import Landing

BLOCK = 1 << 16
PIECE = 1 << 20


def test_a_gate_opens_once_its_bytes_have_landed():
    buf = torch.zeros(1000, dtype=torch.uint8)
    base = buf.data_ptr()
    landing = Landing(base, [(0, 400), (600, 1000)])
    landing.gate(base + 400, base + 600)  # outside the ranges: there already
    opened: list[float] = []
    t = threading.Thread(target=lambda: (landing.gate(base + 300, base + 700),
                                         opened.append(time.monotonic())))
    t.start()
    landing.mark(0, 0, 400)
    landing.mark(1, 600, 650)
    time.sleep(0.2)
    assert not opened  # [650, 700) of the second range is not there yet
    at = time.monotonic()
    landing.mark(1, 650, 700)
    t.join(5)
    assert opened and opened[0] >= at


def test_a_gate_is_woken_once_its_own_bytes_have_landed_not_by_every_piece(monkeypatch):
    """Eight writers woken on every 4 MiB piece took the GIL ~1,400 times each per 5.84 GB save
    beside the training thread: a waiting gate looks again only once its bytes are there."""
    buf = torch.zeros(1000, dtype=torch.uint8)
    base = buf.data_ptr()
    landing = Landing(base, [(0, 1000)])
    looks: list[int] = []
    ready = Landing._ready

    def counted(self, a, b):
        if threading.current_thread().name == "waiter":
            looks.append(a)
        return ready(self, a, b)

    monkeypatch.setattr(Landing, "_ready", counted)
    t = threading.Thread(target=landing.gate, args=(base + 900, base + 1000), name="waiter")
    t.start()
    while not looks:  # it has looked once and waits
        time.sleep(0.001)
    for a in range(0, 900, 10):  # 90 pieces, none of them its bytes
        landing.mark(0, a, a + 10)
        time.sleep(0.0005)
    time.sleep(0.05)
    assert t.is_alive() and len(looks) == 1, f"the waiting gate looked {len(looks)} times"
    landing.mark(0, 900, 1000)
    t.join(5)
    assert not t.is_alive() and len(looks) == 2


def test_a_failed_landing_fails_every_gate_naming_why():
    buf = torch.zeros(100, dtype=torch.uint8)
    landing = Landing(buf.data_ptr(), [(0, 100)])
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            landing.gate(buf.data_ptr(), buf.data_ptr() + 10)
        except CheckpointError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    landing.finish(RuntimeError("CUDA error: an illegal memory access"))
    t.join(5)
    assert len(errors) == 1 and "illegal memory access" in str(errors[0])


def test_pieces_land_in_the_order_asked_for_then_in_address_order_each_once():
    buf = torch.zeros(1000, dtype=torch.uint8)
    base = buf.data_ptr()
    landing = Landing(base, [(100, 1000)])  # pieces of 100: [100, 200) ... [900, 1000)
    got = landing.pieces(0, 100)
    assert next(got) == (0, 100)  # nothing asked for yet: in order
    landing.prefer([(base + 750, base + 760), (base + 150, base + 420), (base + 0, base + 50)])
    rest = list(got)
    # [750, 760) is piece 6; [150, 420) pieces 0 (taken), 1, 2, 3; [0, 50) is outside the range
    assert rest[:4] == [(600, 700), (100, 200), (200, 300), (300, 400)]
    assert rest[4:] == [(400, 500), (500, 600), (700, 800), (800, 900)]
    assert len(rest) + 1 == 9


def test_a_gate_opens_on_bytes_landed_out_of_order_and_not_before():
    buf = torch.zeros(1000, dtype=torch.uint8)
    base = buf.data_ptr()
    landing = Landing(base, [(0, 1000)])
    landing.mark(0, 500, 700)
    assert landing.gate(base + 520, base + 690, timeout=0)
    assert not landing.gate(base + 400, base + 600, timeout=0)  # [400, 500) not yet
    landing.mark(0, 300, 450)
    assert not landing.gate(base + 400, base + 600, timeout=0)  # [450, 500) not yet
    landing.mark(0, 450, 500)
    assert landing.gate(base + 300, base + 700, timeout=0)
    assert not landing.gate(base + 0, base + 310, timeout=0)


def written_while_landing(tmp_path, fail_at: int | None = None, into: bool = False,
                          backwards: bool = False, codecs: dict[str, str] | None = None,
                          landed: list[bool] | None = None):
    """A shard of three tensors (views of one buffer holding garbage) written on 4 threads while
    another thread lands the real bytes a MiB at a time (``into``: into a mapped file of the
    node-local level, filled with garbage too; ``backwards``: the last MiB first; ``codecs``:
    the tensors compressed, by name; ``landed`` is told True once every byte has landed)."""
    real = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    host = torch.full_like(real, 0xEE)
    tensors = {"a": host[: 5 << 20].view(torch.float32),
               "b": host[5 << 20 : (9 << 20) + 8].view(torch.int64),
               "c": host[(9 << 20) + 8 :]}
    landing = Landing(host.data_ptr(), [(0, host.numel())])

    if backwards:  # the way an XOR member's rounds ask for its chunks: its last bytes first
        landing.prefer([(host.data_ptr() + a, host.data_ptr() + a + PIECE)
                        for a in range(host.numel() - PIECE, -1, -PIECE)])

    def land() -> None:
        try:
            for a, b in landing.pieces(0, PIECE):
                if fail_at is not None and a >= fail_at:
                    raise RuntimeError("the copy engine stopped")
                time.sleep(0.01)
                host[a:b].copy_(real[a:b])
                landing.mark(0, a, b)
        except BaseException as e:
            landing.finish(e)
            raise
        landing.finish()
        if landed is not None:
            landed.append(True)

    dest = None
    if into:
        (tmp_path / "s.h5").write_bytes(b"\xdd" * (16 << 20))
        dest = Maps().take(str(tmp_path / "pool"), str(tmp_path), "s.h5")
    w = shard.ShardWriter(str(tmp_path / "s.h5"), tensors, {"tree": "{}"}, into=dest,
                          codecs=codecs, block=BLOCK)
    try:
        w.write(tensors, block=BLOCK, threads=4, meanwhile=land, gate=landing.gate)
    except BaseException:
        w.close()
        raise
    size = w.seal()
    if dest is not None:
        dest.close()
    want = {"a": real[: 5 << 20].view(torch.float32),
            "b": real[5 << 20 : (9 << 20) + 8].view(torch.int64), "c": real[(9 << 20) + 8 :]}
    return w.records, size, want


@pytest.mark.parametrize("backwards", [False, True], ids=["in-order", "backwards"])
@pytest.mark.parametrize("into", [False, True], ids=["file", "into-mapped"])
def test_blocks_written_while_landing_hold_the_landed_bytes(tmp_path, into, backwards):
    records, size, want = written_while_landing(tmp_path, into=into, backwards=backwards)
    out = reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=BLOCK, threads=3)
    for k, t in want.items():  # read_shard checks every block's checksum too
        assert torch.equal(out[k].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), k


def test_compressed_blocks_are_compressed_as_they_land_and_hold_the_landed_bytes(
        tmp_path, monkeypatch):
    """A compressed shard's blocks do not wait for the whole snapshot to land (that made a
    compressed persist of 5.84 GB on an H200 0.9 s longer): compressing starts while the bytes
    still land, and every block holds the landed bytes, not the garbage before them."""
    pytest.importorskip("zstandard")
    from mpickpt.format import codec

    landed: list[bool] = []
    seen: list[bool] = []  # per compressed block: had everything landed when it was compressed
    real_compress = codec.compress_into

    def compress(*a, **k):
        seen.append(bool(landed))
        return real_compress(*a, **k)

    monkeypatch.setattr(codec, "compress_into", compress)
    records, size, want = written_while_landing(tmp_path, codecs={"a": "zstd", "c": "zstd"},
                                                landed=landed)
    assert seen and not all(seen), "every block was compressed only after all had landed"
    assert {r.name for r in records if r.codec} == {"a", "c"}
    out = reader.read_shard(0, str(tmp_path / "s.h5"), records, size, block=BLOCK, threads=3)
    for k, t in want.items():  # read_shard checks every block's checksum too
        assert torch.equal(out[k].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("into", [False, True], ids=["file", "into-mapped"])
def test_a_landing_that_fails_fails_the_write(tmp_path, into, compressed):
    with never_blocks("a write whose landing failed", 30), \
            pytest.raises(RuntimeError, match="copy engine stopped"):
        written_while_landing(tmp_path, fail_at=6 << 20, into=into,
                              codecs={"a": "zstd", "c": "zstd"} if compressed else None)


@pytest.mark.parametrize("n", [0, 1, (1 << 20) - 3, (16 << 20) + 4097])
def test_the_rings_host_copy_copies_every_byte_and_nothing_past_them(n):
    """The ring's CPU copy (one memmove, not torch's OpenMP pool): every byte of the piece, at
    any size, and not one byte past its end."""
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.full((n + 64,), 7, dtype=torch.uint8)
    host_copy(dst[:n], src)
    assert torch.equal(dst[:n], src)
    assert bool((dst[n:] == 7).all())


def test_the_rings_host_copy_runs_on_the_calling_thread_alone_and_the_snapshots_on_more():
    """Beside training the ring's copy takes no thread of mpickpt's besides the persist thread
    (split over three more, it cost two ranks sharing an H200 a training step of +165-260 ms
    per save); inside ``save()`` the snapshot's copy of a large host tensor is split. A fresh
    interpreter: no other test's copies have started the helper threads."""
    code = (
        "import threading, torch\n"
        "from mpickpt.format.hostcopy import copy_into, host_copy\n"
        "def helpers():\n"
        "    return sum(t.name.startswith('mpickpt-copy') for t in threading.enumerate())\n"
        "src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)\n"
        "dst = torch.empty_like(src)\n"
        "host_copy(dst, src)\n"
        "assert torch.equal(dst, src)\n"
        "print(helpers())\n"
        "dst.zero_()\n"
        "copy_into(dst, src)\n"
        "assert torch.equal(dst, src)\n"
        "print(helpers())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "0" and int(out[1]) >= 1, out


@pytest.mark.parametrize("foreach", [True, False])
def test_a_snapshots_copies_in_one_batch_are_the_tensors_whatever_their_kind(
        monkeypatch: pytest.MonkeyPatch, foreach: bool) -> None:
    """copy_all: the small tensors in one call into torch (or a loop, where torch has no
    ``_foreach_copy_``), the large ones by memmove; strided, negative-bit and bfloat16 sources
    come out as their values."""
    if not foreach:
        monkeypatch.setattr(hostcopy, "_FOREACH_COPY", None)
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(16, 16, generator=g) for _ in range(200)]
    srcs += [torch.randn(8, 32, generator=g).t(), torch.randn(64, generator=g).neg().conj(),
             torch.randn(5, generator=g).to(torch.bfloat16), torch.arange(7)[::2],
             torch.randn(hostcopy.SMALL + 1, generator=g), torch.randn(300, 300, generator=g)]
    srcs.append(torch.randn(4, 4, generator=g)._neg_view())
    dsts = [torch.zeros(s.shape, dtype=s.dtype) for s in srcs]
    copy_all(zip(dsts, srcs, strict=True))
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.resolve_neg().resolve_conj())


def test_the_rings_host_copy_refuses_what_is_not_two_contiguous_byte_runs_in_host_memory():
    with pytest.raises(ValueError, match="contiguous byte tensors of one size"):
        host_copy(torch.empty(8, dtype=torch.uint8), torch.empty(9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous byte tensors"):
        host_copy(torch.empty(8, dtype=torch.float32), torch.empty(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous byte tensors"):
        host_copy(torch.empty(16, dtype=torch.uint8)[::2], torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="in host memory"):  # memmove there would crash
        host_copy(torch.empty(8, dtype=torch.uint8, device="meta"),
                  torch.empty(8, dtype=torch.uint8))


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    m = torch.randn(300, 200, generator=g)
    c = torch.randn(64, dtype=torch.complex64, generator=g)
    return {
        "plain": torch.randn(3 << 18, generator=g),  # 3 MiB: over one thread's part
        "param": torch.nn.Parameter(torch.randn(40, 30, generator=g)),  # requires grad
        "bool": torch.rand(1000, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "transposed": m.t(),  # strided: torch's copy
        "offset view": m[7:11],  # contiguous, with a storage offset
        "conjugate": c.conj(),  # a conjugate bit: torch resolves it
        "negative": torch.randn(8, 2, generator=g).to(torch.complex64).conj().imag,
    }


@pytest.mark.parametrize("name", list(_sources()))
def test_the_snapshots_host_copy_gives_what_torch_copy_gives(name):
    """``copy_into`` (memmove for plain contiguous host tensors, torch's ``copy_`` otherwise)
    leaves ``dst`` equal to ``src`` for every kind of host tensor a state may hold."""
    from mpickpt.format.hostcopy import copy_into

    src = _sources()[name]
    dst = torch.empty(src.shape, dtype=src.dtype)
    copy_into(dst, src)
    with torch.no_grad():
        want = src.resolve_conj().resolve_neg().clone()
    assert torch.equal(dst, want), name


def test_an_xor_members_landing_order_is_its_rounds_order():
    """Member 1 of 3, chunks of 300 bytes, rounds of 100: each round takes the block at the
    same offset of each of its two chunks (parity 0 gets chunk 0, parity 2 chunk 1), mapped
    through the tensors' runs to their host addresses (a gap between runs stays out)."""
    import numpy as np

    from mpickpt.local.parity import Run, landing_order

    runs = [Run(0, np.zeros(250, np.uint8), 10_000), Run(260, np.zeros(340, np.uint8), 20_000)]
    got = landing_order(runs, 3, 1, 300, 100)
    assert got == [
        (10_000, 10_100),                        # round 0: [0, 100) of chunk 0
        (20_040, 20_140),                        # and [300, 400) of chunk 1
        (10_100, 10_200), (20_140, 20_240),      # round 1: [100, 200), [400, 500)
        (10_200, 10_250), (20_000, 20_040),      # round 2: [200, 300) less the gap
        (20_240, 20_340)]                        # and [500, 600)
