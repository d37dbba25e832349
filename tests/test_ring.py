"""The restore's ring of slots (mpickpt/local/ring.py): a slot is written again only once what
read it is done, a transfer that fails wakes whoever waits for a slot, and a ring too small for
its slots is refused; its slots are there before their page-locked twins are."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from mpickpt.local.ring import SLOTS, Ring, RingAbandoned, pinned_ring, slot_bytes


def test_a_slot_is_free_again_only_once_every_reader_of_its_last_group_is_done() -> None:
    ring = Ring(torch.zeros(SLOTS * 8, dtype=torch.uint8), 8)
    for r in range(SLOTS):  # the first SLOTS groups: their slots are free from the start
        ring.wait_free(r)
    readers = [Future[None](), Future[None]()]
    ring.release_after(0, readers)
    waited = threading.Event()
    t = threading.Thread(target=lambda: (ring.wait_free(SLOTS), waited.set()))
    t.start()
    readers[0].set_result(None)
    assert not waited.wait(0.2), "group SLOTS got slot 0 while its last group was being read"
    readers[1].set_exception(RuntimeError("a failed check still frees the slot"))
    assert waited.wait(5), "group SLOTS never got slot 0 once its readers were done"
    t.join()
    assert ring.slot(SLOTS).data_ptr() == ring.slot(0).data_ptr()
    ring.release_after(1, [])  # nothing read it: free at once
    ring.wait_free(SLOTS + 1)


def test_an_abandoned_transfer_wakes_whoever_waits_for_a_slot() -> None:
    ring = Ring(torch.zeros(SLOTS * 8, dtype=torch.uint8), 8)
    got: list[BaseException] = []

    def wait() -> None:
        try:
            ring.wait_free(SLOTS)
        except RingAbandoned as e:
            got.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    ring.abandon()
    t.join(5)
    assert not t.is_alive() and len(got) == 1, got


def test_a_buffer_too_small_for_the_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="6 slots of 8 bytes needs 48 bytes"):
        Ring(torch.zeros(8, dtype=torch.uint8), 8)


def test_a_pinned_rings_slots_are_whole_checksum_blocks_of_their_own_memory() -> None:
    assert slot_bytes(1 << 20) == 64 << 20 and slot_bytes(256 << 20) == 256 << 20
    ring, close = pinned_ring(1 << 20, pin=False)
    try:
        assert [s.numel() for s in ring.slots] == [64 << 20] * SLOTS
        assert len({s.data_ptr() for s in ring.slots}) == SLOTS
    finally:
        close()


def test_a_ring_slot_that_cannot_be_page_locked_is_used_pageable(monkeypatch) -> None:
    """Page-locking one slot's twin fails: that slot stays in ordinary memory (slower copies),
    not refused; every other slot is taken page-locked once made, and all are given back at
    close."""
    from mpickpt.save.pinned_pool import HostPool

    calls: list[int] = []

    def lock(self: HostPool, buf: torch.Tensor) -> bool:
        calls.append(buf.data_ptr())
        if len(calls) == 4:
            raise RuntimeError("cudaHostRegister error 2")
        return True

    monkeypatch.setattr(HostPool, "lock", lock)
    ring, close = pinned_ring(4096, pin=True)
    try:
        for r in range(SLOTS):  # every slot used once: the twins are made
            ring.release_after(r, [])
        concurrent.futures.wait(ring.twins)
        assert len(calls) == SLOTS
        slots = [ring.slot(k) for k in range(SLOTS)]
        plain = [s.data_ptr() for s in ring.slots]
        assert [s.data_ptr() in plain for s in slots] == [k == 3 for k in range(SLOTS)]
        assert len({s.data_ptr() for s in slots}) == SLOTS
        assert ring.slot(SLOTS + 1).data_ptr() == slots[1].data_ptr()
    finally:
        close()


@pytest.mark.quick
def test_the_first_receives_do_not_wait_for_page_locking(monkeypatch) -> None:
    """Every slot is there at once in ordinary memory, and nothing is page-locked while the
    first bytes land in them (page-locking a first slot held the copies out of the others
    back, on a host of two H200s); once every slot was used, page-locked twins are made,
    later groups of a slot land in its twin, and a group that already took the ordinary slot
    keeps it."""
    from mpickpt.save.pinned_pool import HostPool

    go = threading.Event()
    locked: list[int] = []

    def lock(self: HostPool, buf: torch.Tensor) -> bool:
        assert go.wait(10), "the test did not let page-locking go on"
        locked.append(buf.data_ptr())
        return True

    monkeypatch.setattr(HostPool, "lock", lock)
    ring, close = pinned_ring(4096, pin=True)
    try:
        t = time.monotonic()
        first = [ring.slot(k).data_ptr() for k in range(SLOTS)]
        assert time.monotonic() - t < 5, "the slots waited for page-locking"
        assert first == [s.data_ptr() for s in ring.slots]
        go.set()
        for r in range(SLOTS - 1):
            ring.release_after(r, [])
        time.sleep(0.2)
        assert not locked and not ring.warm.is_set(), "page-locked before every slot was used"
        ring.release_after(SLOTS - 1, [])
        concurrent.futures.wait(ring.twins)
        assert [ring.slot(SLOTS + k).data_ptr() for k in range(SLOTS)] == locked
        assert not set(locked) & set(first)
    finally:
        go.set()
        close()


def test_a_ring_let_go_before_its_slots_were_all_used_page_locks_nothing(monkeypatch) -> None:
    """A transfer of fewer groups than slots (or an XOR rebuild, which keeps the buffers it
    took) never needs the twins: closing the ring makes none and does not wait for any."""
    from mpickpt.save.pinned_pool import HostPool

    calls: list[int] = []
    monkeypatch.setattr(HostPool, "lock", lambda self, buf: calls.append(1) or True)
    ring, close = pinned_ring(4096, pin=True)
    ring.release_after(0, [])
    close()
    assert not calls
    assert all(isinstance(t.exception(1), RingAbandoned) for t in ring.twins)
