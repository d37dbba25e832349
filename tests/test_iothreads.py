"""mpickpt/format/iothreads.py: an executor's threads made ahead of their use."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpickpt.format import iothreads


def named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


@pytest.mark.quick
@pytest.mark.parametrize("size", [1, 4])
def test_prestart_makes_every_thread_and_later_tasks_make_none(size: int) -> None:
    prefix = f"test-prestart-{size}"
    ex = ThreadPoolExecutor(size, thread_name_prefix=prefix)
    try:
        assert named(prefix) == 0
        iothreads.prestart(ex, size)
        assert named(prefix) == size
        meet = threading.Barrier(size)  # every thread busy at once: still none made
        for f in [ex.submit(meet.wait, 10) for _ in range(size)]:
            f.result()
        assert named(prefix) == size
    finally:
        ex.shutdown()
