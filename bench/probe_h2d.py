"""What a restore's last step costs on a GPU host: the host->device copy of a shard's bytes from
pageable memory, against page-locking the buffer first (cudaHostRegister, as a restore into a
new process's buffers did) and copying from it; and the hash-and-copy into a node-local file
(the local level's write) with torch's intra-op threads at the rank's share of the cores and at 1.

    python bench/probe_h2d.py --gb 3 --threads 16        # prints a table, writes --json

Each figure: the median of --reps after a warm-up; fresh buffers where the row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--json", default="probe-h2d.json")
    a = ap.parse_args()
    n = int(a.gb * 1e9)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8)
    host.fill_(1)
    rows: dict[str, float] = {}
    rows["h2d from pageable memory"] = timed(lambda: dev.copy_(host), a.reps)

    def fresh_pageable() -> None:
        h = torch.empty(n, dtype=torch.uint8)
        h.fill_(2)  # the pages a read into it would fault in
        dev.copy_(h)

    rows["fresh pageable buffer: touch + h2d"] = timed(fresh_pageable, a.reps)

    def fresh_locked(make=lambda: torch.empty(n, dtype=torch.uint8), parts=None) -> None:
        t = time.perf_counter()
        h = make()
        h.fill_(3)
        touched = time.perf_counter()
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(h.data_ptr(), n, 0)) == 0
        locked = time.perf_counter()
        dev.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(h.data_ptr())
        if parts is not None:
            parts.append((touched - t, locked - touched))

    small_parts: list[tuple[float, float]] = []
    rows["fresh buffer: touch + page-lock + h2d (a restore before)"] = timed(
        lambda: fresh_locked(parts=small_parts), a.reps)
    # the pool's buffers since: an anonymous mapping advised to use transparent huge pages
    from mpickpt.save.pinned_pool import host_buffer, huge_pages_on_request

    huge_parts: list[tuple[float, float]] = []
    rows["fresh huge-page buffer: touch + page-lock + h2d (a restore now)"] = timed(
        lambda: fresh_locked(lambda: host_buffer(n), huge_parts), a.reps)
    for name, parts in (("", small_parts), ("huge-page ", huge_parts)):
        rows[f"  of which: touching a fresh {name}buffer"] = statistics.median(
            p[0] for p in parts[1:])
        rows[f"  of which: page-locking the touched {name}buffer"] = statistics.median(
            p[1] for p in parts[1:])
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(4)
    rows["h2d from page-locked memory"] = timed(lambda: dev.copy_(pinned, non_blocking=True),
                                                 a.reps)

    # the local level's write: hash + copy into a mapped file, 512 KiB at a time
    import mmap

    import xxhash
    path = "/dev/shm/probe-h2d.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n)
    dst = torch.frombuffer(m, dtype=torch.uint8)
    dst.fill_(0)

    def hash_copy(piece: int) -> None:
        h = xxhash.xxh3_64()
        src = host
        for p in range(0, n, piece):
            k = min(piece, n - p)
            h.update(memoryview(src[p:p + k].numpy()))
            dst[p:p + k].copy_(src[p:p + k])

    for threads in (a.threads, 1):
        for piece in (512 << 10, 16 << 20):
            def run(piece: int = piece, threads: int = threads) -> None:
                out: list[float] = []

                def body() -> None:
                    torch.set_num_threads(threads)
                    t = time.perf_counter()
                    hash_copy(piece)
                    out.append(time.perf_counter() - t)
                th = threading.Thread(target=body)  # on a thread of its own, as the save's
                th.start()
                th.join()
            rows[f"hash + copy into /dev/shm, {piece >> 10} KiB pieces, {threads} torch "
                 "threads (a background thread)"] = timed(run, a.reps)
    os.close(fd)
    os.unlink(path)  # (the map goes with the process)
    width = max(map(len, rows))
    print(f"{'what':{width}}  {'s':>7}  {'GB/s':>7}   ({n / 1e9:.2f} GB, "
          f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs)")
    for k, v in rows.items():
        print(f"{k:{width}}  {v:7.3f}  {n / v / 1e9:7.2f}")
    print(f"transparent huge pages on request: {huge_pages_on_request()}")
    with open(a.json, "w") as f:
        json.dump({"bytes": n, "device": torch.cuda.get_device_name(), "cpus": os.cpu_count(),
                   "huge_pages_on_request": huge_pages_on_request(), "seconds": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
