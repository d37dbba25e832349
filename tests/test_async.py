"""The asynchronous save path on CPU tensors, in one process (MPI world of one)."""

from __future__ import annotations

import itertools
import json
import logging
import time

import pytest
import torch

import mpickpt
from mpickpt import faults


@pytest.fixture
def fault():
    yield faults.configure
    faults.configure("")


def big_state(mb: int = 64) -> dict:
    return {"w": torch.arange(mb << 18, dtype=torch.float32), "step": 0}


def test_save_returns_a_handle_with_stats_and_appends_stats_jsonl(tmp_path):
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, big_state(8))
        r = h.wait()
        assert h.done() and r.committed
        for key in ("stall_s", "persist_s", "persist_GBps", "commit_s", "bytes", "copy_s"):
            assert r.stats[key] > 0, key
    line = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[-1])
    assert line["step"] == 1 and line["bytes"] == r.stats["bytes"]


def test_mutating_right_after_save_does_not_reach_the_checkpoint(tmp_path, fault):
    fault("after-fsync-before-vote:0:delay")  # the write is surely still in flight
    state = big_state(16)
    expected = state["w"].clone()
    with mpickpt.Checkpointer(tmp_path) as ck:
        h = ck.save(1, state)
        state["w"].add_(1.0)  # the training loop goes on at once
        assert not h.done()
        assert h.wait().committed
        fresh = {"w": torch.zeros_like(expected), "step": -1}
        assert ck.restore(fresh) == 1
    assert torch.equal(fresh["w"], expected)


def test_one_in_flight_makes_the_next_save_wait_and_says_so(tmp_path, fault, caplog):
    fault("after-fsync-before-vote:0:delay")
    caplog.set_level(logging.INFO, logger="mpickpt")
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(max_in_flight=1)) as ck:
        ck.save(1, big_state())
        h2 = ck.save(2, big_state())
        assert h2.wait().stats["waited_for_buffer_s"] > 0.5
        assert ck.pinned_bytes == 64 << 20
    assert "save of step 2 waits for an earlier save to finish persisting" in caplog.text


def test_two_in_flight_use_a_second_buffer_without_waiting(tmp_path, fault):
    fault("after-fsync-before-vote:0:delay")
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(max_in_flight=2)) as ck:
        h1 = ck.save(1, big_state())
        h2 = ck.save(2, big_state())
        assert not h1.done()
        assert h2.wait().stats["waited_for_buffer_s"] < 0.5
        assert h1.wait().committed and h2.wait().committed
        assert ck.pinned_bytes == 2 * (64 << 20)


def test_the_pool_takes_out_the_buffer_itself_in_any_order():
    """Buffers given back in another order than they were made: reuse takes the smallest that
    fits, a too small one is replaced, and close() lets all go (the pool once took them out of
    its lists by comparing tensors by value, which raised as soon as one was not first)."""
    from mpickpt.save.pinned_pool import HostPool

    pool = HostPool(1 << 30, slots=2, pin=False)
    a, b = pool.acquire(8 << 20), pool.acquire(4 << 20)
    pool.release(a)
    pool.release(b)  # free: [a, b]; the smaller that fits is b, not first
    assert pool.acquire(4 << 20) is b
    pool.release(b)
    c = pool.acquire(16 << 20)  # none fits and no slot is left: one free buffer is replaced
    assert c is not a and c is not b and pool.in_flight() == 1
    pool.release(c)
    assert pool.in_flight() == 0 and pool.allocated_bytes > 0
    pool.close()
    assert pool.allocated_bytes == 0 and pool.in_flight() == 0


def test_buffers_are_reused_not_grown(tmp_path):
    with mpickpt.Checkpointer(tmp_path, keep=2) as ck:
        for step in range(5):
            ck.save(step, big_state(4)).wait()
        assert ck.pinned_bytes == 4 << 20


def test_snapshot_over_the_budget_aborts_with_a_clear_error(tmp_path):
    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(pinned_budget=1 << 20)) as ck:
        r = ck.save(1, big_state(4)).wait()
    assert not r.committed
    assert "does not fit this rank's host buffer budget" in r.error
    assert not list(tmp_path.glob("step-*"))


def test_background_failure_raises_on_the_next_save_with_on_error_raise(tmp_path, fault):
    fault("mid-write:0:raise:1")
    with mpickpt.Checkpointer(tmp_path, on_error="raise") as ck:
        h = ck.save(1, big_state(1))  # fails in the background; nobody waits for it
        while not h.done():
            time.sleep(0.01)
        with pytest.raises(mpickpt.SaveAborted, match=r"step 1 aborted.*injected fault"):
            ck.save(2, big_state(1))


def test_background_failure_with_on_error_warn_is_logged_and_training_goes_on(
        tmp_path, fault, caplog):
    fault("mid-write:0:raise:1")
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert not ck.save(1, big_state(1)).wait().committed
        assert ck.save(2, big_state(1)).wait().committed
    assert "checkpoint of step 1 aborted on all ranks" in caplog.text


def test_unsupported_state_raises_at_save(tmp_path):
    with mpickpt.Checkpointer(tmp_path) as ck, pytest.raises(mpickpt.StateTreeError):
        ck.save(1, {"bad": object()})


def test_the_users_mistake_is_what_save_raises_also_with_on_error_raise(tmp_path):
    with mpickpt.Checkpointer(tmp_path, on_error="raise", replicated=("modle",)) as ck:
        with pytest.raises(mpickpt.StateTreeError, match="'modle' matches nothing"):
            ck.save(1, {"model": {"w": torch.zeros(2)}})
        with pytest.raises(mpickpt.MetadataError, match=r"metadata\['x'\]"):
            ck.save(2, {"modle": torch.zeros(2)}, metadata={"x": object()})
        assert ck.save(3, {"modle": torch.zeros(2)}).wait().committed  # nothing left to raise


def test_a_snapshot_that_fails_gives_its_buffer_back(tmp_path, monkeypatch):
    """A failure after the buffer was taken (a GPU out of memory for staging, say) must not keep
    it: with max_in_flight=1 the next save would wait for it forever."""
    from mpickpt.save import layout

    real = layout.view

    def failing(*args):
        raise RuntimeError("out of memory")

    with mpickpt.Checkpointer(tmp_path, snapshots=mpickpt.Snapshots(max_in_flight=1)) as ck:
        monkeypatch.setattr(layout, "view", failing)
        result = ck.save(1, big_state(1)).wait()
        assert not result.committed and "out of memory" in result.error
        monkeypatch.setattr(layout, "view", real)
        assert ck.save(2, big_state(1)).wait(timeout=60).committed


def test_a_buffer_the_pool_lets_go_takes_its_cached_views_with_it():
    """The snapshot's views of a pool buffer are kept for the next save of the same layout;
    when the pool replaces the buffer (the state grew) or closes, they go, and so does the
    buffer's memory (the views hold it)."""
    import functools
    import gc
    import weakref

    from mpickpt.save import layout
    from mpickpt.save.pinned_pool import HostPool

    def run(hooked: bool) -> bool:
        pool = HostPool(1 << 30, slots=1, pin=False)
        views = layout.Views()
        if hooked:
            pool.dropped.append(views.forget)
        state = {"a": torch.zeros(1000), "b": torch.zeros(3, 7, dtype=torch.float64)}
        _, _, offsets, _, pos, key = layout.place(state)
        buf = pool.acquire(pos)
        first = views.get(buf, None, key, functools.partial(layout.views, buf, offsets, state))
        assert views.get(buf, None, key, lambda: {}) is first  # the same layout: kept
        other = layout.place({"a": state["a"]}).key
        assert views.get(buf, None, other, lambda: {"x": 1}) == {"x": 1}  # another: made
        gone = weakref.ref(buf)
        pool.release(buf)
        del buf, first
        pool.release(pool.acquire(pos * 4))  # no slot left: the small buffer is replaced
        gc.collect()
        freed = gone() is None
        pool.close()
        return freed

    assert run(hooked=True)
    assert not run(hooked=False)  # without the pool's word, the views would keep it


def test_saves_of_one_layout_and_then_another_are_each_exact(tmp_path):
    """Saves of the same layout reuse the buffer's views; a changed shape, dtype or set of
    tensors makes new ones: every step restores exactly what was saved."""
    states = [{"w": torch.full((64, 64), float(i)), "b": torch.arange(10) + i} for i in range(3)]
    states.append({"w": torch.full((32, 128), 3.0), "b": torch.arange(10) + 3})  # a shape
    states.append({"w": torch.full((32, 128), 4.0, dtype=torch.float64),
                   "b": torch.arange(10) + 4})  # a dtype
    states.append({"w": torch.full((32, 128), 5.0), "b": torch.arange(10) + 5,
                   "c": torch.ones(5)})  # one more tensor
    with mpickpt.Checkpointer(tmp_path, keep=len(states)) as ck:
        for step, state in enumerate(states):
            ck.save(step, state).wait()
        for step, state in enumerate(states):
            into = {k: torch.empty_like(v) for k, v in state.items()}
            assert ck.restore(into, step=step) == step
            for k, v in state.items():
                assert torch.equal(into[k], v), (step, k)


def test_small_tensors_share_the_snapshots_pages_and_come_back_bit_exact(tmp_path):
    """A tensor under a page starts on a cache line of the snapshot's buffer, one of a page or
    more on a page (O_DIRECT can write it from there); none overlaps another, and a state of
    every kind of size and dtype saves and restores bit for bit."""
    from mpickpt.format.blocks import ALIGN
    from mpickpt.save import layout

    g = torch.Generator().manual_seed(3)
    state = {f"s{i}": torch.randn(i % 7 + 1, generator=g).to(dt)
             for i, dt in enumerate([torch.float32, torch.float64, torch.bfloat16, torch.int8,
                                     torch.float16, torch.complex64] * 5)}
    state |= {"empty": torch.zeros(0), "page": torch.randn(1024, generator=g),
              "big": torch.randn(5000, generator=g), "last": torch.ones(3, dtype=torch.int16)}
    placed = layout.place(state)
    spans = sorted((placed.offsets[n], placed.offsets[n] + t.nbytes) for n, t in state.items())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for n, t in state.items():
        assert placed.offsets[n] % (ALIGN if t.nbytes >= ALIGN else layout.SMALL_ALIGN) == 0, n
    assert placed.total % ALIGN == 0 and spans[-1][1] <= placed.total
    assert placed.total == 7 * ALIGN  # the small ones 1 page, "page" 1, "big" 5 (a page each: 38)
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert ck.save(1, state).wait().committed
        fresh = {n: torch.zeros_like(t) for n, t in state.items()}
        assert ck.restore(fresh) == 1
    for n, t in state.items():
        assert fresh[n].dtype == t.dtype and torch.equal(fresh[n].view(-1).view(torch.uint8),
                                                         t.view(-1).view(torch.uint8)), n
