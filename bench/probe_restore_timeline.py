"""Where a restore from the node-local level spends its time, per rank: a timeline of its parts
(the inventory's collectives, the plan, the reads and their verification, the transfers, the
page-locking, the load into the state), for a restart on the same nodes ("own") and after a
lost node ("lost": rank 1's node directory wiped).

Every rank is a simulated node with ``bench_levels``'s MLP + Adam (``--gb`` in all; by default
the reference job, 5.84 GB), on the GPU when there is one, the level in ``/dev/shm`` with
partner redundancy. Three saves, then restores in new Checkpointers: own, own, lost, own.

    mpiexec -n 2 python bench/probe_restore_timeline.py [--gb 0.1] [--modes lost,lost,lost]
    mpirun -n 2 --bind-to none python bench/probe_restore_timeline.py   # Open MPI: unbound

Each rank prints the CPUs it may run on: Open MPI's mpirun binds two ranks to a core each by
default, and a rank's I/O threads then share that core (the restore measures that core).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_levels as bl
import restore_parts
import torch

import mpickpt
from mpickpt.background import usable_cpus
from mpickpt.local.nodedir import node_dirname


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=None, help="state in GB (default 5.84)")
    ap.add_argument("--modes", default="own,own,lost,own",
                    help="the restores, in order (own or lost; default own,own,lost,own)")
    a = ap.parse_args()
    restore_parts.install()
    rank = bl.RANK
    print(f"rank {rank} may run on {usable_cpus()} CPU(s)", flush=True)
    os.environ["MPICKPT_NODE"] = f"n{rank}"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # a GPU per rank where there are several
        torch.cuda.set_device(rank % torch.cuda.device_count())
    layers, width = bl.shape(a.gb, None)
    mine = [i for i in range(layers) if i % bl.SIZE == rank]
    model, optim = bl.build(len(mine), width, 1 + rank, 1e-3, device)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    root = bl.COMM.bcast(tempfile.mkdtemp(dir="/tmp") if rank == 0 else None)
    local = bl.COMM.bcast(tempfile.mkdtemp(dir="/dev/shm") if rank == 0 else None)

    def checkpointer() -> mpickpt.Checkpointer:
        return mpickpt.Checkpointer(root, local=mpickpt.Local(local, redundancy="partner",
                                                              persist_every=None))

    try:
        ck = checkpointer()
        for step in (1, 2, 3):
            ck.save(step, state).wait()
        ck.close()
        for mode in a.modes.split(","):
            ck = checkpointer()
            bl.COMM.Barrier()
            if mode == "lost" and rank == 1:
                shutil.rmtree(os.path.join(local, node_dirname("n1")), ignore_errors=True)
            bl.COMM.Barrier()
            restore_parts.EVENTS.clear()
            t0 = time.perf_counter()
            ck.restore(state)
            bl.sync_device(device)
            took = time.perf_counter() - t0
            ck.close()
            lines = restore_parts.lines(t0)
            for r in range(bl.SIZE):
                bl.COMM.Barrier()
                if r == rank:
                    print(f"== {mode}: rank {rank} restored in {took:.3f} s, "
                          f"{ck.restore_info.mapped_bytes:,} bytes mapped", flush=True)
                    print("\n".join(lines), flush=True)
    finally:
        bl.COMM.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
