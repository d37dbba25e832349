"""Probe: how fast can one process write a 3 GB shard into /dev/shm? pwrite vs a memory map,
1 or 8 threads, with and without posix_fallocate, on fresh and on reused pages.

    python bench/probe_shm.py [GB]
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

N = int(float(sys.argv[1] if len(sys.argv) > 1 else 3) * 1e9) // (32 << 20) * (32 << 20)
B = 32 << 20
SRC = torch.randint(0, 255, (N,), dtype=torch.uint8)
if torch.cuda.is_available():
    SRC = SRC.pin_memory()


def run(mode: str, threads: int, falloc: bool) -> float:
    path = f"/dev/shm/probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    if falloc:
        os.posix_fallocate(fd, 0, N)
    else:
        os.ftruncate(fd, N)
    if mode == "pwrite":
        view = memoryview(SRC.numpy())

        def task(i: int) -> None:
            os.pwrite(fd, view[i:i + B], i)
    else:
        m = mmap.mmap(fd, N)
        dst = torch.frombuffer(m, dtype=torch.uint8)

        def task(i: int) -> None:
            dst[i:i + B].copy_(SRC[i:i + B])
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(task, range(0, N, B)))
    dt = time.perf_counter() - t
    if mode != "pwrite":
        del dst
        m.close()
    os.close(fd)
    os.unlink(path)
    return N / dt / 1e9


torch.set_num_threads(1)
for rnd in ("first", "again"):
    for mode in ("pwrite", "mmap"):
        for threads in (1, 8):
            for falloc in (False, True):
                print(f"{rnd:5} {mode:6} threads={threads} fallocate={falloc!s:5} "
                      f"{run(mode, threads, falloc):6.2f} GB/s", flush=True)
