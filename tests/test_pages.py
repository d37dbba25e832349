"""mpickpt/format/pages.py: a map's pages faulted in or let go through the C library, without
holding the GIL; no byte of the file changes either way."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest
import torch

from mpickpt.format import pages

SIZE = 16 << 20


def shared_map(path: str, write: bool) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    return fd, mmap.mmap(fd, SIZE, mmap.MAP_SHARED, prot)


@pytest.fixture
def data_file(tmp_path) -> tuple[str, bytes]:
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


@pytest.mark.quick
def test_populate_and_unmap_keep_every_byte(data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    fd, m = shared_map(path, write=True)
    try:
        base = pages.address(m)
        assert pages.populate(base, 0, SIZE, write=False)  # (Linux >= 5.14 here)
        assert pages.populate(base, mmap.PAGESIZE, SIZE - mmap.PAGESIZE, write=True)
        assert m[:] == data
        m[5:9] = b"abcd"  # written through the map, then its pages let go
        pages.unmap(m, piece=1 << 20)
        assert m.closed
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == data[:5] + b"abcd" + data[9:]


def test_a_range_not_mapped_is_refused_not_a_crash(data_file: tuple[str, bytes]) -> None:
    path, _ = data_file
    fd, m = shared_map(path, write=False)
    base = pages.address(m)
    m.close()
    os.close(fd)
    assert not pages.populate(base, 0, SIZE)


def test_populating_lets_other_threads_run(tmp_path) -> None:
    """While one thread populates a large map, another keeps running Python code: the call
    does not hold the GIL (``mmap.madvise`` does: the other thread then stops for all of it)."""
    path, size = str(tmp_path / "big"), 512 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    base, gaps, stop, running = pages.address(m), [0.0], threading.Event(), threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        running.set()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    running.wait()
    try:
        start = time.perf_counter()
        assert pages.populate(base, 0, size)
        took = time.perf_counter() - start
    finally:
        stop.set()
        t.join()
        m.close()
        os.close(fd)
    assert max(gaps) < 0.5 * took or took < 0.01, (max(gaps), took)


@pytest.mark.quick
def test_a_restores_new_buffer_is_faulted_in_behind_without_a_byte_changed(monkeypatch):
    from mpickpt.save import pinned_pool
    from mpickpt.save.pinned_pool import HostPool, Taken

    started = []
    real = pinned_pool.fault_in_behind
    monkeypatch.setattr(pinned_pool, "fault_in_behind",
                        lambda buf, stop=None: started.append(real(buf, stop)) or started[-1])
    n = pinned_pool.BEHIND_FROM + 3 * mmap.PAGESIZE + 5  # (not whole pieces, nor pages)
    held = Taken(HostPool(1 << 30, slots=1, pin=False))
    buf = held.take(n, lock=False)
    head = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    buf[: 1 << 20] = torch.from_numpy(head)  # written while the thread faults the rest in
    assert len(started) == 1
    started[0].join(timeout=30)
    assert not started[0].is_alive()
    first = -buf.data_ptr() % mmap.PAGESIZE
    whole = (n - first) // mmap.PAGESIZE * mmap.PAGESIZE
    assert pages.resident(buf.data_ptr() + first, whole) == whole // mmap.PAGESIZE
    assert np.array_equal(buf[: 1 << 20].numpy(), head)
    assert not buf[1 << 20:].any()  # a new buffer's pages: zeros, as the kernel gives them
    held.release()
    again = held.take(n, lock=False)  # the same buffer again: its pages are there
    assert again.data_ptr() == buf.data_ptr() and len(started) == 1
    held.release()
    small = Taken(HostPool(1 << 30, slots=1, pin=False))
    small.take(pinned_pool.BEHIND_FROM - 1, lock=False)
    assert len(started) == 1  # below the size, a buffer's pages come at their first touch
    unpinned = Taken(HostPool(1 << 30, slots=1, pin=False))
    unpinned.take(n, lock=True)  # a pool that does not page-lock: faulted in all the same
    assert len(started) == 2
    started[1].join(timeout=30)
    unpinned.release()


@pytest.mark.quick
def test_an_unaligned_view_is_faulted_in_whole_pages_only_and_keeps_its_bytes():
    from mpickpt.save.pinned_pool import BEHIND_PIECE, fault_in_behind, host_buffer

    whole = host_buffer(BEHIND_PIECE + 7 * mmap.PAGESIZE)
    data = np.random.default_rng(6).integers(0, 256, whole.numel(), dtype=np.uint8)
    whole.copy_(torch.from_numpy(data))
    view = whole[5 : whole.numel() - 3]  # starts and ends inside a page
    fault_in_behind(view).join(timeout=30)
    assert np.array_equal(whole.numpy(), data)
    stop = threading.Event()
    stop.set()
    fault_in_behind(host_buffer(4 * BEHIND_PIECE), stop).join(timeout=30)  # stops at once
