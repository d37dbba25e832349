"""A lost node's bytes received into new host memory, as a restore without GPU room gets them:
rank 0 sends ``--mb`` MB in 32 MiB messages, rank 1 receives them into memory touched before
(what the bench's transfer bound measures), into new pages, and into new pages that a helper
thread maps in ahead of the receive (``MADV_POPULATE_WRITE``, Linux 5.14; it changes no byte,
so it may run beside MPI's copy); and, into memory touched before, sent out of a file in
``--shm`` mapped (its pages mapped in by a warm-up transfer), as the level serves a partner
copy and an XOR team's survivors send their blocks. Alternating, ``--reps`` times; the
slowest rank's time.

    mpiexec -n 2 python bench/probe_fresh_recv.py [--mb 252] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import threading
import time

import numpy as np
from mpi4py import MPI

from mpickpt.format import pages
from mpickpt.local.filemap import FileMap

COMM = MPI.COMM_WORLD
MESSAGE = 32 << 20
KINDS = ("touched", "new pages", "new pages, populated beside", "touched, sent from a mapped file")


def populate(m: mmap.mmap, size: int) -> None:
    """Map ``m``'s pages in, a message at a time, in the receive's order."""
    base = pages.address(m)  # (through ctypes: mmap.madvise would hold the GIL)
    for a in range(0, size, MESSAGE):
        pages.populate(base, a, min(MESSAGE, size - a), write=True)


def once(kind: str, size: int, src: np.ndarray, touched: np.ndarray,
         mapped: np.ndarray | None) -> float:
    """One transfer of ``kind``: seconds, the slowest rank's."""
    COMM.Barrier()
    t = time.perf_counter()
    if COMM.rank == 0:
        out = mapped if kind == KINDS[3] else src
        MPI.Request.Waitall([COMM.Isend([out[a:a + MESSAGE], MPI.BYTE], 1)
                             for a in range(0, size, MESSAGE)])
    elif COMM.rank == 1:
        m, helper = None, None
        if kind in (KINDS[0], KINDS[3]):
            dst = touched
        else:
            m = mmap.mmap(-1, size)
            dst = np.frombuffer(m, np.uint8)
            if kind == KINDS[2]:
                helper = threading.Thread(target=populate, args=(m, size))
                helper.start()
        MPI.Request.Waitall([COMM.Irecv([dst[a:a + MESSAGE], MPI.BYTE], 0)
                             for a in range(0, size, MESSAGE)])
        if helper is not None:
            helper.join()
        if not dst[::4096].all():
            raise RuntimeError(f"{kind}: the received bytes are not the ones sent")
        del dst
    return COMM.allreduce(time.perf_counter() - t, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=252, help="MB received (default 252)")
    ap.add_argument("--reps", type=int, default=3, help="rounds, each kind once (default 3)")
    ap.add_argument("--json", help="write the times here")
    ap.add_argument("--shm", default="/dev/shm", help="where the mapped file goes (/dev/shm)")
    args = ap.parse_args()
    if COMM.size != 2:
        raise SystemExit("run with 2 ranks: mpiexec -n 2 python bench/probe_fresh_recv.py")
    size = args.mb << 20
    src = np.ones(size, np.uint8)
    touched = np.zeros(size, np.uint8)
    path = os.path.join(args.shm, f"probe-fresh-recv-{os.getpid()}.bin")
    with contextlib.ExitStack() as files:
        mapped = None
        if COMM.rank == 0:
            src.tofile(path)
            files.callback(os.unlink, path)
            mapped = files.enter_context(FileMap(path, size)).view(0, size)
        # warm-up: the touched buffer's pages, and the mapped file's, come in here
        for kind in (KINDS[0], KINDS[3]):
            once(kind, size, src, touched, mapped)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(args.reps):
            for kind in KINDS:
                times[kind].append(once(kind, size, src, touched, mapped))
        del mapped
    if COMM.rank == 0:
        print(f"{args.mb} MB in {MESSAGE >> 20} MiB messages, {args.reps} rounds")
        print(f"{'into':34s} {'median ms':>9s} {'each ms':>24s} {'GB/s':>6s}")
        for kind, ts in times.items():
            med = statistics.median(ts)
            each = ", ".join(f"{1e3 * x:.1f}" for x in ts)
            print(f"{kind:34s} {1e3 * med:9.1f} {each:>24s} {size / med / 1e9:6.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": size, "seconds": times}, f, indent=1)


if __name__ == "__main__":
    main()
