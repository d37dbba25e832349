"""Probe: how long one rank takes to page-lock the slots of a restore's ring (64 MiB each, one
at a time, as ``mpickpt.local.ring.pinned_ring`` does) while another rank of the host is busy,
by what that rank does meanwhile. On the 2-GPU H200 host a lost node's first ring slot took
0.30-0.39 s to lock during the partner restore, against 27 ms on the one-GPU host, and 23-31 ms
when each rank saw only its own GPU (docs/performance.md, s60).

    mpirun -n 2 --bind-to none python bench/probe_pin.py [--slots 6] [--gb 2]

Rank r runs on ``cuda:(r % GPUs)``. For each thing rank 0 does (nothing; copies of its state to
its GPU from page-locked memory, again and again, its buffers made first; page-locking 8 fresh
64 MiB buffers at once, as a restore's bounce buffers; reading a file in ``/dev/shm`` into
memory), rank 1 makes and locks ``--slots`` slots, each: a new buffer (huge pages where the
kernel gives them), zeroed, then ``cudaHostRegister``. Printed: each slot's zeroing and
locking, in ms. Measured on that host (``results-h200/pin-h200x2-20261129-s60-*.txt``): 1.3-5 ms
per lock whatever rank 0 did, its copies to GPU 0 included (``-twogpus-fixed``; the first two
runs' ``h2d`` rows are void: rank 0's copies had not begun), so the probe does not reproduce the
restore's wait.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
from mpi4py import MPI

from mpickpt.save.pinned_pool import host_buffer

COMM = MPI.COMM_WORLD
SLOT = 64 << 20


def busy(what: str, gb: float, ready: threading.Event, stop: threading.Event) -> int:
    """Rank 0's activity until ``stop`` (``ready`` set once it has begun): the times it went
    round."""
    n, rounds = int(gb * 1e9) // SLOT * SLOT, 0
    if what == "h2d":  # (its buffers made and locked before it says it is ready)
        src = host_buffer(n, huge=True)
        src.zero_()
        torch.cuda.cudart().cudaHostRegister(src.data_ptr(), n, 0)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        ready.set()
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rounds += 1
        torch.cuda.cudart().cudaHostUnregister(src.data_ptr())
    elif what == "pin":
        ready.set()
        while not stop.is_set():
            bufs = [host_buffer(SLOT, huge=True) for _ in range(8)]

            def lock(b: torch.Tensor) -> None:
                b.zero_()
                torch.cuda.cudart().cudaHostRegister(b.data_ptr(), SLOT, 0)

            threads = [threading.Thread(target=lock, args=(b,)) for b in bufs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for b in bufs:
                torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
            rounds += 1
    elif what == "read":
        path = f"/dev/shm/probe-pin-{os.getpid()}"
        with open(path, "wb") as f:
            f.truncate(n)
        buf = bytearray(SLOT)
        fd = os.open(path, os.O_RDONLY)
        ready.set()
        try:
            while not stop.is_set():
                for off in range(0, n, SLOT):
                    os.preadv(fd, [buf], off)
                rounds += 1
        finally:
            os.close(fd)
            os.unlink(path)
    else:
        ready.set()
        stop.wait()
    return rounds


def report(what: str, gb: float, ready: threading.Event, stop: threading.Event) -> None:
    print(f"rank 0 ({what}): {busy(what, gb, ready, stop)} rounds", flush=True)


def lock_slots(slots: int) -> list[tuple[float, float]]:
    out, held = [], []
    for _ in range(slots):
        t0 = time.perf_counter()
        b = host_buffer(SLOT, huge=True)
        b.zero_()
        t1 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(b.data_ptr(), SLOT, 0)
        t2 = time.perf_counter()
        assert int(err) == 0, err
        held.append(b)
        out.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    for b in held:
        torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--gb", type=float, default=2.0)
    a = ap.parse_args()
    torch.cuda.set_device(COMM.rank % torch.cuda.device_count())
    torch.ones(1, device="cuda").sum().item()  # the context, before anything is timed
    if COMM.rank == 1:
        lock_slots(1)  # the process's first registration, apart
    for what in ("idle", "h2d", "pin", "read", "idle"):
        COMM.Barrier()
        ready, stop = threading.Event(), threading.Event()
        if COMM.rank == 0:
            worker = threading.Thread(target=report, args=(what, a.gb, ready, stop))
            worker.start()
            ready.wait()
        COMM.Barrier()  # rank 1 locks once rank 0 is at it
        time.sleep(0.2)
        times = lock_slots(a.slots) if COMM.rank == 1 else []
        COMM.Barrier()
        stop.set()
        if COMM.rank == 0:
            worker.join()
        if COMM.rank == 1:
            cells = "  ".join(f"{z:5.1f}+{r:6.1f}" for z, r in times)
            print(f"rank 1 on cuda:{torch.cuda.current_device()}, rank 0 {what:5}: slot ms "
                  f"(zero+lock) {cells}", flush=True)
        COMM.Barrier()


if __name__ == "__main__":
    main()
