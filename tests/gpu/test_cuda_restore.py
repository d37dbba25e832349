"""A restore from ROOT into a state on the GPU: each block read into a page-locked buffer of its
I/O thread, verified there, copied into GPU memory set aside; the state takes it after the vote.

Skipped without a GPU (CI has none); run on a GPU machine: python -m pytest tests/gpu -v
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import flip_data_byte
from test_cuda import model_and_opt, step, values

import mpickpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def saved(root: Path, steps: int) -> list[list[torch.Tensor]]:
    """``steps`` checkpoints of a trained model on the GPU under ``root``; each one's values."""
    m, opt = model_and_opt(0)
    x = torch.randn(512, 1024, device="cuda")
    out = []
    with mpickpt.Checkpointer(root, keep=steps) as ck:
        for i in range(steps):
            step(m, opt, x)
            out.append(values(m, opt))
            assert ck.save(i, {"model": m, "optim": opt}).wait().committed
    return out


def gpu_bytes(m, opt) -> int:
    """The bytes of the model's and the optimizer's tensors that live on the GPU."""
    return sum(t.numel() * t.element_size() for t in values(m, opt) if t.is_cuda)


@pytest.mark.parametrize("room", ["1", "0"])
@pytest.mark.parametrize("fresh", [False, True], ids=["optimizer-with-state", "fresh-optimizer"])
def test_a_new_checkpointer_restores_from_root_through_gpu_room_bit_exact(tmp_path, monkeypatch,
                                                                          room, fresh):
    """A restarted job's restore (a new Checkpointer): bit-exact either way. Through the room,
    every tensor saved from the GPU comes through it and no host buffer that large is
    allocated: also a fresh optimizer's state (no live tensors: it goes onto the GPU the
    state is on, in memory of its own that the optimizer keeps, neither cloned nor moved by
    its load_state_dict). The room is given back, and the GPU memory at the peak is the
    state's and the room's, no more."""
    monkeypatch.setenv("MPICKPT_RESTORE_GPU_ROOM", room)
    ref = saved(tmp_path, 1)[0]
    m, opt = model_and_opt(1)
    if not fresh:
        step(m, opt, torch.randn(512, 1024, device="cuda"))
    live = gpu_bytes(m, opt)  # the targets live on the GPU before the restore
    state_bytes = sum(t.numel() * t.element_size() for t in ref)
    on_gpu = sum(t.numel() * t.element_size() for t in ref if t.is_cuda)
    slack = 4096 * len(ref)
    with mpickpt.Checkpointer(tmp_path) as ck:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        assert ck.restore({"model": m, "optim": opt}) == 0
        peak = torch.cuda.max_memory_allocated() - before  # (gpu_bytes below clones)
        # the room given back: what stays is the state's own (a fresh optimizer's, new)
        grown = torch.cuda.memory_allocated() - before
        assert grown <= gpu_bytes(m, opt) - live + (1 << 20), (grown, live)
        assert peak <= on_gpu + (4 << 20), (peak, on_gpu, grown)  # no copy of new tensors
        info = ck.restore_info
        if room == "1":
            assert on_gpu - 4096 <= info.room_bytes <= on_gpu + slack, (info, on_gpu)
            assert ck._pool.allocated_bytes <= state_bytes - on_gpu + slack
        else:
            assert info.room_bytes == 0
            assert ck._pool.allocated_bytes >= state_bytes - 64
    got = values(m, opt)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert a.device == b.device and torch.equal(a, b)
    for st in opt.state.values():
        for v in st.values():
            if v.is_cuda:
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size()


@pytest.mark.quick
def test_a_damaged_block_read_into_gpu_room_never_reaches_the_state(tmp_path, monkeypatch):
    """The newest step's shard damaged: its blocks go through the room's page-locked buffers
    until the bad one, the restore falls back to the older step (every block of which comes
    the same way); with no older step, the state is still the job's own."""
    from mpickpt.restore import device_room

    calls: list[int] = []
    real = device_room.Bounce.__call__

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(device_room.Bounce, "__call__", counting)
    refs = saved(tmp_path, 2)
    _, tensor = flip_data_byte(tmp_path, 1, rank=0)
    m, opt = model_and_opt(1)
    x = torch.randn(512, 1024, device="cuda")
    step(m, opt, x)
    with mpickpt.Checkpointer(tmp_path, keep=2) as ck:
        assert ck.restore({"model": m, "optim": opt}) == 0
        assert ck.restore_info.room_bytes >= gpu_bytes(m, opt) - 4096
        (skipped, why), = ck.restore_info.skipped
        assert skipped == 1 and "checksum mismatch" in why and tensor in why, why
    blocks = sum(-(-t.numel() * t.element_size() // (64 << 20)) for t in refs[0] if t.is_cuda)
    assert len(calls) > blocks, (len(calls), blocks)  # step 0's, and some of step 1's
    for a, b in zip(values(m, opt), refs[0], strict=True):
        assert torch.equal(a, b)
    flip_data_byte(tmp_path, 0, rank=0)
    m2, opt2 = model_and_opt(2)
    step(m2, opt2, x)
    before = values(m2, opt2)
    with mpickpt.Checkpointer(tmp_path, keep=2) as ck:
        assert ck.restore({"model": m2, "optim": opt2}) is None
    for a, b in zip(values(m2, opt2), before, strict=True):
        assert torch.equal(a, b), "a damaged checkpoint's bytes reached the state"
