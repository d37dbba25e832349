"""CUDA snapshot path: copies on a side stream, fences against the next mutation, bit-exact.

Skipped without a GPU (CI has none); run on a GPU machine: python -m pytest tests/gpu -v
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mpickpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model_and_opt(seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
        *[torch.nn.Linear(1024, 1024) for _ in range(6)],
    ).cuda().to(dtype)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, opt


def step(m, opt, x):
    m(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def values(m, opt) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in m.state_dict().values()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values()]
    return out


@pytest.mark.parametrize("staging", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_step_right_after_save_does_not_race_the_copy(tmp_path, staging, dtype):
    m, opt = model_and_opt(0, dtype)
    x = torch.randn(4096, 1024, device="cuda", dtype=dtype)
    step(m, opt, x)
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(device_staging=staging)) as ck:
        state = {"model": m, "optim": opt}
        for i in range(3):
            expected = values(m, opt)
            h = ck.save(i, state)
            for _ in range(3):  # mutate at once: forward (BatchNorm stats), backward, step
                step(m, opt, x)
            assert h.wait().committed
            m2, opt2 = model_and_opt(1, dtype)
            step(m2, opt2, x)  # optimizer state exists, will be overwritten in place
            assert ck.restore({"model": m2, "optim": opt2}, step=i) == i
            got = values(m2, opt2)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert a.device == b.device and torch.equal(a, b)  # Adam's step stays on CPU


def tensors_of(x) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, list | tuple) else []
    return [t for v in items for t in tensors_of(v)]


@pytest.mark.parametrize("staging", [True, False])
def test_a_state_of_state_dicts_is_safe_from_the_next_step_at_once(tmp_path, staging):
    """What the Lightning and Hugging Face integrations save: ``state_dict()``s, whose tensors no
    hook of ours guards. The next optimizer step, and an in-place change of a tensor, right
    after save() returns, must not reach the snapshot."""
    m, opt = model_and_opt(0)
    x = torch.randn(4096, 1024, device="cuda")
    step(m, opt, x)
    big = torch.randn(256 << 20, device="cuda")  # 1 GiB: a copy long enough to be raced
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(device_staging=staging)) as ck:
        for i in range(3):
            state = {"model": m.state_dict(), "optim": opt.state_dict(), "big": big}
            expected = [t.clone() for t in tensors_of(state)]
            h = ck.save(i, state)
            big.add_(1.0)  # at once, on the current stream
            for _ in range(2):
                step(m, opt, x)
            assert h.wait().committed
            m2, opt2 = model_and_opt(1)
            step(m2, opt2, x)  # the same structure, other values
            fresh = {"model": m2.state_dict(), "optim": opt2.state_dict(),
                     "big": torch.zeros_like(big)}
            assert ck.restore(fresh, step=i) == i
            got = tensors_of(fresh)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("staging", [True, False])
def test_a_module_saved_without_its_optimizer_is_safe_from_the_step_that_follows(tmp_path,
                                                                                 staging):
    """A module in the state guards its buffers (its forward pass waits for the snapshot), not
    its parameters: saved between backward and the optimizer's step, with the optimizer not in
    the state, that step must not reach the snapshot."""
    m, opt = model_and_opt(0)
    x = torch.randn(4096, 1024, device="cuda")
    step(m, opt, x)
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(device_staging=staging)) as ck:
        for i in range(3):
            m(x).float().square().mean().backward()
            expected = [t.clone() for t in m.state_dict().values()]
            h = ck.save(i, {"model": m})
            opt.step()  # at once: no forward pass of m comes first
            opt.zero_grad()
            assert h.wait().committed
            m2, _ = model_and_opt(1)
            assert ck.restore({"model": m2}, step=i) == i
            got = list(m2.state_dict().values())
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)


@pytest.mark.quick
def test_save_returns_before_the_copy_finishes(tmp_path):
    m, opt = model_and_opt(0)
    step(m, opt, torch.randn(256, 1024, device="cuda"))
    big = {"model": m, "optim": opt, "extra": torch.randn(256 << 20, device="cuda")}  # 1 GiB
    with mpickpt.Checkpointer(tmp_path) as ck:
        ck.save(0, big).wait()  # allocates the host buffer
        torch.cuda.synchronize()
        h = ck.save(1, big)
        assert h.wait().stats["stall_s"] < 0.05, h.wait().stats
        assert h.wait().committed


def test_wait_snapshot_protects_direct_mutation(tmp_path):
    t = torch.randn(64 << 20, device="cuda")
    expected = t.clone()
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(0, {"t": t})
        ck.wait_snapshot()
        t.add_(1)
        assert h.wait().committed
        fresh = {"t": torch.zeros_like(t)}
        ck.restore(fresh)
    assert torch.equal(fresh["t"], expected)


def test_rng_state_with_cuda_round_trips(tmp_path):
    torch.cuda.manual_seed(3)
    torch.rand(10, device="cuda")
    with mpickpt.Checkpointer(tmp_path) as ck:
        ck.save(0, {"rng": mpickpt.RNGState()}).wait()
        expected = torch.rand(10, device="cuda")
        torch.rand(100, device="cuda")
        ck.restore({"rng": mpickpt.RNGState()})
    assert torch.equal(torch.rand(10, device="cuda"), expected)


def test_first_save_page_locks_its_buffer_off_the_training_thread(tmp_path, allocations):
    threads = allocations
    m, opt = model_and_opt(0)
    x = torch.randn(1024, 1024, device="cuda")
    step(m, opt, x)
    expected = values(m, opt)
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(0, {"model": m, "optim": opt})
        step(m, opt, x)  # the copy must not see this step
        assert h.wait().committed
        assert threads and all(t.startswith("mpickpt-snapshot") for t in threads), threads
        m2, opt2 = model_and_opt(1)
        step(m2, opt2, x)
        ck.restore({"model": m2, "optim": opt2}, step=0)
    for a, b in zip(values(m2, opt2), expected, strict=True):
        assert torch.equal(a, b)



def test_a_checkpointer_made_once_cuda_is_in_use_takes_no_stream_in_the_first_save(
        tmp_path, monkeypatch):
    """The copy stream is made with the Checkpointer (and by prepare()): the first stream
    taken from PyTorch's pool creates the device's whole pool, about 0.1 s that the first
    save's window would otherwise pay. So is a first copy on it (the first ``_foreach_copy_``
    loads its kernels: 0.013-0.026 s on an H200). The save is still bit exact."""
    m, opt = model_and_opt(0)
    x = torch.randn(1024, 1024, device="cuda")
    step(m, opt, x)
    made: list[object] = []
    real = torch.cuda.Stream

    class Counted(real):  # type: ignore[misc, valid-type]
        def __new__(cls, *a, **k):
            if "stream_id" not in k:  # one from the pool (current_stream() wraps one it has)
                made.append(k.get("device", a[0] if a else None))
            return super().__new__(cls, *a, **k)

    monkeypatch.setattr(torch.cuda, "Stream", Counted)
    copies: list[str] = []
    real_copy = torch._foreach_copy_

    def counted_copy(dst, src, *a, **k):
        copies.append(src[0].device.type)
        return real_copy(dst, src, *a, **k)

    monkeypatch.setattr(torch, "_foreach_copy_", counted_copy)
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert len(made) == 1, made  # with the Checkpointer: CUDA was in use already
        assert copies == ["cuda"], copies  # and its first copy on the GPU
        expected = values(m, opt)
        h = ck.save(0, {"model": m, "optim": opt})
        assert len(made) == 1, made  # none in the save
        step(m, opt, x)
        assert h.wait().committed
        m2, opt2 = model_and_opt(1)
        ck.restore({"model": m2, "optim": opt2}, step=0)
    for a, b in zip(values(m2, opt2), expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("room", ["1", "0"])
def test_first_save_page_locks_nothing_its_staging_goes_through_the_ring(tmp_path, monkeypatch,
                                                                         room):
    """Without prepare(), the pool's buffer stays pageable: the snapshot's GPU staging buffer is
    emptied through the small page-locked ring, bit exact. A restore through GPU room leaves
    it so (the next save goes through the ring again); one through host memory page-locks it
    (it runs before the loop), and the next save empties the staging buffer into it straight."""
    from mpickpt.save import snapshot

    monkeypatch.setenv("MPICKPT_RESTORE_GPU_ROOM", room)

    m, opt = model_and_opt(0)
    x = torch.randn(1024, 1024, device="cuda")
    step(m, opt, x)
    rings: list[bool] = []
    real = snapshot.unstage

    def spy(stream, src, dst, ring=None, on_landed=None, order=None):
        rings.append(ring is not None)
        return real(stream, src, dst, ring, on_landed, order)

    snapshot.unstage = spy
    try:
        with mpickpt.Checkpointer(tmp_path) as ck:
            # the ring is page-locked with the Checkpointer: CUDA was in use already
            assert ck._capture.snapshotter._ring is not None
            expected = values(m, opt)
            h = ck.save(0, {"model": m, "optim": opt})
            step(m, opt, x)  # the copy must not see this step
            assert h.wait().committed
            assert ck._pool.allocated_bytes > 0 and ck._pool.locked_bytes == 0
            assert rings == [True]
            m2, opt2 = model_and_opt(1)
            step(m2, opt2, x)
            ck.restore({"model": m2, "optim": opt2}, step=0)
            for a, b in zip(values(m2, opt2), expected, strict=True):
                assert torch.equal(a, b)
            if room == "1":
                assert ck.restore_info.room_bytes > 0 and ck._pool.locked_bytes == 0
            else:
                assert ck._pool.locked_bytes > 0  # the restore's buffer, the pool's
            after = values(m2, opt2)
            assert ck.save(1, {"model": m2, "optim": opt2}).wait().committed
            assert rings == [True, room == "1"]
            step(m2, opt2, x)
            ck.restore({"model": m2, "optim": opt2}, step=1)
            for a, b in zip(values(m2, opt2), after, strict=True):
                assert torch.equal(a, b)
    finally:
        snapshot.unstage = real


def test_blocks_are_written_as_they_land_bit_exact(tmp_path, monkeypatch):
    """A save's staging buffer is emptied into host memory while the I/O threads write the
    blocks that have landed (mpickpt.save.landing): each block waits at its gate, the pieces
    land one after another, and what the loop does meanwhile never reaches the checkpoint."""
    from mpickpt.save import landing

    gates: list[tuple[int, int]] = []
    landed: list[int] = []
    real_gate, real_mark = landing.Landing.gate, landing.Landing.mark
    monkeypatch.setattr(landing.Landing, "gate",
                        lambda self, a, b: (gates.append((a, b)), real_gate(self, a, b))[1])
    monkeypatch.setattr(landing.Landing, "mark",  # each piece's end: in order, nothing asked
                        lambda self, k, a, b: (landed.append(b), real_mark(self, k, a, b))[1])
    m, opt = model_and_opt(0)
    x = torch.randn(1024, 1024, device="cuda")
    step(m, opt, x)
    with mpickpt.Checkpointer(tmp_path, io_threads=4,
                              files=mpickpt.Files(checksum_block=1 << 20)) as ck:
        for i in range(2):
            expected = values(m, opt)
            h = ck.save(i, {"model": m, "optim": opt})
            step(m, opt, x)  # the copy must not see this step
            assert h.wait().committed
            m2, opt2 = model_and_opt(1)
            step(m2, opt2, x)
            assert ck.restore({"model": m2, "optim": opt2}, step=i) == i
            for a, b in zip(values(m2, opt2), expected, strict=True):
                assert torch.equal(a, b)
    restarts = sum(1 for a, b in itertools.pairwise(landed) if b < a)
    assert restarts == 1 and len(landed) >= 4  # two saves, each landing in several pieces
    blocks = sum(-(-t.numel() * t.element_size() // (1 << 20)) for t in expected if t.is_cuda)
    assert len(gates) >= 2 * blocks


def test_prepare_page_locks_and_no_room_to_stage_page_locks_with_a_hint(tmp_path, monkeypatch,
                                                                        caplog):
    import logging

    from mpickpt.save import capture

    monkeypatch.setattr(capture, "HINT_BYTES", 1)
    caplog.set_level(logging.INFO, logger="mpickpt")
    m, opt = model_and_opt(0)
    step(m, opt, torch.randn(1024, 1024, device="cuda"))
    state = {"model": m, "optim": opt}
    with mpickpt.Checkpointer(tmp_path / "a") as ck:
        ck.prepare(state)
        assert ck._pool.locked_bytes >= ck._pool.allocated_bytes > 0
        assert ck.save(0, state).wait().committed
    assert "Checkpointer.prepare(state)" not in caplog.text
    no_staging = mpickpt.Snapshots(device_staging=False)
    with mpickpt.Checkpointer(tmp_path / "b", snapshots=no_staging) as ck:
        assert ck.save(0, state).wait().committed  # copied straight: page-locked on the spot
        assert ck._pool.locked_bytes > 0
        assert ck.save(1, state).wait().committed
    assert caplog.text.count("call Checkpointer.prepare(state) before the training loop") == 1


@pytest.mark.parametrize("compression", [None, "zstd+shuffle"])
def test_incremental_saves_of_a_partly_frozen_cuda_model_restore_bit_exact(tmp_path, compression):
    if compression:
        pytest.importorskip("zstandard", reason="compression is the 'compress' extra")
    """The first three modules (a Linear, a BatchNorm, a ReLU) frozen (requires_grad False)
    and declared with frozen=: every
    incremental save copies only what trains, refers to the rest, and each step restores into a
    fresh CUDA model exactly as it was when saved."""
    m, _ = model_and_opt(0)
    for p in m[:3].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(1024, 1024, device="cuda")
    step(m, opt, x)
    saved = {}
    enc = mpickpt.Encoding(incremental=3, compression=compression,
                           frozen=mpickpt.frozen_params(m))
    with mpickpt.Checkpointer(tmp_path, encoding=enc) as ck:
        state = {"model": m, "optim": opt}
        for i in range(1, 6):
            step(m, opt, x)
            saved[i] = [t.detach().clone() for t in m.state_dict().values()]
            r = ck.save(i, state).wait()
            if i == 1:
                saved_bytes = r.stats["snapshot_bytes"]
            assert r.committed
            if i in (2, 3, 5):  # after the full saves 1 and 4: the frozen layers are elided
                assert r.stats["reused_bytes"] >= 1024 * 1024 * 4, r.stats  # the Linear's weight
                assert r.stats["snapshot_bytes"] < saved_bytes - 1024 * 1024 * 4, r.stats
    for i in (3, 5):
        m2, _ = model_and_opt(1)
        for p in m2[:3].parameters():
            p.requires_grad_(False)
        opt2 = torch.optim.Adam([p for p in m2.parameters() if p.requires_grad], lr=1e-3)
        step(m2, opt2, x)
        with mpickpt.Checkpointer(tmp_path) as ck:
            assert ck.restore({"model": m2, "optim": opt2}, step=i) == i
        for a, b in zip(m2.state_dict().values(), saved[i], strict=True):
            assert a.is_cuda and torch.equal(a, b)
