"""What page faults cost a transfer between two ranks: 25 messages of 4 MiB (100 MiB) sent from
warm memory or from a file in ``/dev/shm`` mapped into memory, received into warm or untouched
memory, waited for all at once or a message at a time (as ``local/remote.fetch`` waits for a lost
shard's groups). Rank 1 prints a line per case; no JSON (a probe behind a figure of
docs/performance.md, not a benchmark).

    mpiexec -n 2 python bench/probe_recv_faults.py
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import time

import numpy as np
import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD
N, M = 25, 4 << 20


def case(path: str, pool: cf.ThreadPoolExecutor, how: str, src: str, dst: str) -> float:
    """Seconds to move the messages, from rank 0's ``src`` into rank 1's ``dst``."""
    rank = COMM.rank
    if src == "mapped":
        fd = os.open(path, os.O_RDONLY)
        whole = memoryview(mmap.mmap(fd, N * M, mmap.MAP_SHARED, mmap.PROT_READ))
        os.close(fd)
        bufs = [whole[i * M:(i + 1) * M] for i in range(N)]
    else:
        bufs = [np.ones(M, np.uint8) for _ in range(N)]
    if rank == 1:
        into = torch.empty(N * M, dtype=torch.uint8)
        if dst == "warm":
            into.fill_(1)
        bufs = [into[i * M:(i + 1) * M].numpy() for i in range(N)]
    COMM.Barrier()
    t = time.perf_counter()
    if rank == 0:
        pool.submit(MPI.Request.Waitall, [COMM.Isend(b, 1, 7) for b in bufs]).result()
    else:
        reqs = [COMM.Irecv(b, 0, 7) for b in bufs]
        if how == "all":
            pool.submit(MPI.Request.Waitall, reqs).result()
        else:
            for f in [pool.submit(MPI.Request.Waitall, [q]) for q in reqs]:
                f.result()
    COMM.Barrier()
    return time.perf_counter() - t


def main() -> None:
    path = f"/dev/shm/probe-recv-faults-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, N * M, dtype=np.uint8).tobytes())
    pool = cf.ThreadPoolExecutor(1)
    try:
        for rnd in range(2):
            for src in ("warm", "mapped"):
                for dst in ("warm", "untouched"):
                    for how in ("all", "each"):
                        took = case(path, pool, how, src, dst)
                        if COMM.rank == 1:
                            print(f"round {rnd + 1}: from {src:6s} into {dst:9s} waited "
                                  f"{how:4s}: {1e3 * took:6.1f} ms for {N * M >> 20} MiB",
                                  flush=True)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
