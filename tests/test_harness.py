"""tests/harness.py's own helpers that decide what the suite removes."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest
from harness import orphan_segments


@pytest.mark.quick
def test_only_a_segment_nobody_maps_and_nobody_touched_lately_is_an_orphan() -> None:
    tag = f"/dev/shm/mpich_shm_test{os.getpid()}"
    paths = {f"{tag}_old", f"{tag}_mapped", f"{tag}_new"}
    for p in paths:
        Path(p).write_bytes(b"\0" * mmap.PAGESIZE)
    old = time.time() - 600
    os.utime(f"{tag}_old", (old, old))
    os.utime(f"{tag}_mapped", (old, old))
    fd = os.open(f"{tag}_mapped", os.O_RDWR)
    m = mmap.mmap(fd, mmap.PAGESIZE)  # a rank still using it
    try:
        assert orphan_segments(paths) == [f"{tag}_old"]
        assert orphan_segments(paths | {f"{tag}_gone"}) == [f"{tag}_old"]  # (removed meanwhile)
    finally:
        m.close()
        os.close(fd)
        for p in paths:
            os.unlink(p)
