"""Probe: how fast can a rank read its node-local shard back out of /dev/shm, and check it?

The ways a restore from the level could take a 3 GB shard (a file in ``/dev/shm``) on the host:
mapped and hashed in place by 1, 4 or 8 threads (each variant in a fresh process, as a restarted
rank's page tables are cold), mapped with ``MADV_POPULATE_READ`` first, and read with ``pread``
into a reused buffer (pageable or page-locked) and hashed there; on a GPU, the load of 3 GB into
the device from the mapped file (pageable) and from a page-locked buffer. xxh3-64 of 64 MiB
blocks, as the format's checksums are. On a GPU host every variant runs twice: in a process
without CUDA, and in one that has made its CUDA context and a page-locked 3 GB buffer first, as a
restoring rank has; ``iothreads`` rows run on mpickpt's own I/O threads instead of a plain pool.
``--procs 2``: two such processes at once, each on a file of its own (two ranks of one host, as
the level's benchmarks run them); the slowest one's time.

    python bench/probe_shm_read.py [--gb 3] [--json bench/results/shm-read.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

B = 64 << 20
MADV_POPULATE_READ = 22


def one(path: str, how: str, threads: int, cuda: bool) -> float:
    """Seconds to read and hash the file ``how`` (map, populate, pread, pread-pinned; a
    ``-iothreads`` suffix: on mpickpt's I/O threads), after making a CUDA context if ``cuda``."""
    import torch  # imported before the clock, as a rank has it

    from mpickpt.format import checksum
    from mpickpt.format.iothreads import run_tasks
    size = os.path.getsize(path)
    held = None
    if cuda:
        torch.zeros(1, device="cuda")
        held = torch.empty(size, dtype=torch.uint8).pin_memory()
    ours = how.endswith("-iothreads")
    how = how.removesuffix("-iothreads")
    fd = os.open(path, os.O_RDONLY)
    starts = list(range(0, size, B))
    buf = None
    if how.startswith("pread"):
        buf = torch.empty(size, dtype=torch.uint8)
        if how == "pread-pinned":
            buf = buf.pin_memory()
        buf.fill_(1)  # reused: its pages exist
    t = time.perf_counter()
    if how in ("map", "populate"):
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        view = memoryview(m)

        def task(a: int) -> None:
            if how == "populate":
                m.madvise(MADV_POPULATE_READ, a, min(B, size - a))
            checksum.digest(view[a:a + B])
    else:
        dest = memoryview(buf.numpy())

        def task(a: int) -> None:
            os.preadv(fd, [dest[a:a + B]], a)
            checksum.digest(dest[a:a + B])
    if ours:
        run_tasks([(a, 0) for a in starts], lambda a, _: task(a), threads)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(task, starts))
    took = time.perf_counter() - t
    del held
    return took


def h2d(path: str) -> dict[str, float]:
    """Seconds to load the file into the GPU: from the map (pageable), from a pinned copy."""
    import torch
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    src = torch.frombuffer(memoryview(m), dtype=torch.uint8)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    pinned.copy_(src)
    out = {}
    for name, s in (("h2d_mapped_s", src), ("h2d_pinned_s", pinned), ("h2d_mapped_again_s", src)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "shm-read.json"))
    ap.add_argument("--procs", type=int, default=1, help="processes at once (1)")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(one(a.one[0], a.one[1], int(a.one[2]), a.one[3] == "cuda"))
        return
    paths = [f"/dev/shm/probe-read-{os.getpid()}-{i}" for i in range(a.procs)]
    size = int(a.gb * 1e9) // B * B
    piece = os.urandom(1 << 20) * 64
    for path in paths:
        with open(path, "wb") as f:
            for _ in range(size // B):
                f.write(piece)
    rows = []
    try:
        for cuda in ([False, True] if _cuda() else [False]):
            for how, threads in [("map", 1), ("map", 8), ("map-iothreads", 8), ("populate", 8),
                                 ("pread", 8), ("pread-iothreads", 8), ("pread-pinned", 8),
                                 ("map", 8)]:
                if how == "pread-pinned" and not _cuda():
                    continue
                procs = [subprocess.Popen([sys.executable, __file__, "--one", path, how,
                                           str(threads), "cuda" if cuda else "-"],
                                          stdout=subprocess.PIPE, text=True) for path in paths]
                outs = [p.communicate()[0] for p in procs]
                if any(p.returncode for p in procs):
                    raise RuntimeError(f"{how}: a process failed")
                s = max(float(out.strip().splitlines()[-1]) for out in outs)
                rows.append({"how": how, "threads": threads, "cuda": cuda, "s": s,
                             "GBps": size / s / 1e9})
        extra = h2d(paths[0]) if _cuda() else {}
    finally:
        for path in paths:
            os.unlink(path)
    print(f"{size / 1e9:.2f} GB in /dev/shm per process, {a.procs} process(es) at once, "
          f"xxh3-64 of {B >> 20} MiB blocks")
    print(f"{'how':16} {'threads':>7} {'CUDA':>5} {'s':>7} {'GB/s':>7}")
    for r in rows:
        print(f"{r['how']:16} {r['threads']:>7} {'yes' if r['cuda'] else 'no':>5} "
              f"{r['s']:7.3f} {r['GBps']:7.2f}")
    for k, v in extra.items():
        print(f"{k}: {v:.3f} s ({size / v / 1e9:.1f} GB/s)")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"bytes": size, "procs": a.procs, "rows": rows, **extra}, f, indent=1)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
