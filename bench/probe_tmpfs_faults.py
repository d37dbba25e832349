"""Whether dropping the page cache slows the page faults of tmpfs files that outlive it.

    python bench/probe_tmpfs_faults.py                  # 256 MiB in /dev/shm, 3 rounds
    python bench/probe_tmpfs_faults.py --mb 1024 --dir /dev/shm --json /tmp/faults.json

A file in ``--dir`` (tmpfs: the node-local level's home) is written; then, in each round, a
fresh map of it is read (every page faulted in while ``xxh3`` hashes it, as a restore verifies
a node's own shard where it lies), populated ahead (``MADV_POPULATE_READ``, as a served copy
is) and read with ``pread`` into a reused buffer (no fault). The same after ``echo 3 >
/proc/sys/vm/drop_caches`` (root only), for the same file and for one written after the
drop. On this project's 2-core VM (Linux 6.18) the faults on the file that outlived the drop
cost about four times as much from then on, its ``pread`` did not change, and a new file was
as fast as before: a benchmark that drops the whole cache to make a restore from disk honest
also slows every later restore from the node-local level on such a kernel. Hence
``bench_levels.py --cache files`` (the default): only the files the bench wrote on disk are
evicted.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from mpickpt.format import pages

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # (its drop_caches)

PIECE = 8 << 20


def write(path: str, nbytes: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for a in range(0, nbytes, PIECE):
            f.write(rng.integers(0, 256, min(PIECE, nbytes - a), dtype=np.uint8).tobytes())


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def mapped(path: str, nbytes: int, populate: bool) -> float:
    """Seconds to bring a fresh map of ``path`` in: populated ahead, or faulted in page by
    page while ``xxh3`` hashes it."""
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    view = memoryview(m)
    try:
        if populate:
            base = pages.address(m)
            return timed(lambda: pages.populate(base, 0, nbytes))
        return timed(lambda: [xxhash.xxh3_64_intdigest(view[a:a + PIECE])
                              for a in range(0, nbytes, PIECE)])
    finally:
        view.release()
        m.close()


def measure(path: str, nbytes: int, buf: bytearray) -> dict[str, float]:
    """Seconds for: a fresh map hashed (its faults), a fresh map populated, pread."""
    out = {"fault+hash": mapped(path, nbytes, False), "populate": mapped(path, nbytes, True)}
    with open(path, "rb", buffering=0) as f:
        out["pread"] = timed(lambda: f.readinto(buf))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="file size in MiB (256)")
    ap.add_argument("--dir", default="/dev/shm", help="where the files go (/dev/shm)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per case (3)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    nbytes = a.mb << 20
    old = os.path.join(a.dir, f"probe-tmpfs-faults-{os.getpid()}-old")
    new = os.path.join(a.dir, f"probe-tmpfs-faults-{os.getpid()}-new")
    buf = bytearray(nbytes)
    rows: dict[str, list[dict[str, float]]] = {}
    why = None
    try:
        write(old, nbytes)
        rows["before the drop"] = [measure(old, nbytes, buf) for _ in range(a.rounds)]
        why = bench_cpu.drop_caches()
        if why is None:
            rows["after: the file that outlived it"] = [measure(old, nbytes, buf)
                                                        for _ in range(a.rounds)]
            write(new, nbytes)
            rows["after: a file written since"] = [measure(new, nbytes, buf)
                                                   for _ in range(a.rounds)]
    finally:
        for p in (old, new):
            if os.path.exists(p):
                os.unlink(p)
    print(f"{a.mb} MiB in {a.dir}, Linux {os.uname().release}, median of {a.rounds}, seconds")
    print(f"{'case':36s} {'fault+hash':>10s} {'populate':>9s} {'pread':>7s}")
    med = {k: {c: statistics.median(r[c] for r in v) for c in v[0]} for k, v in rows.items()}
    for k, m in med.items():
        print(f"{k:36s} {m['fault+hash']:10.4f} {m['populate']:9.4f} {m['pread']:7.4f}")
    if why is not None:
        print(f"the page cache could not be dropped ({why}): only the first row")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mb": a.mb, "dir": a.dir, "kernel": os.uname().release, "rows": rows,
                       "median": med, "drop_error": why}, f, indent=1)


if __name__ == "__main__":
    main()
