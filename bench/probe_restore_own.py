"""A restart from the node-local level's own shards, alone (``bench_levels.py``'s restart row).

Every rank is a simulated node (``$MPICKPT_NODE=n<rank>``) with ``--gb`` of state on the CPU
(eight float32 tensors), the level in ``--local`` (default ``/dev/shm``) with partner
redundancy. Two saves, then one Checkpointer restores ``--reps`` + 1 times into the zeroed state,
each checked bit for bit; the slowest rank's time (barrier to barrier). The first restore of a
process is reported apart (it makes its buffers); the median of the rest is the figure. To
compare two versions of the package in one session, run it under each with ``PYTHONPATH``
pointing at a checkout (``git worktree add``)::

    mpiexec -n 2 python bench/probe_restore_own.py --gb 0.4 --out own.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from mpi4py import MPI

import mpickpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.4, help="state per rank, GB (default 0.4)")
    ap.add_argument("--reps", type=int, default=5, help="timed restores after the first")
    ap.add_argument("--local", default="/dev/shm", help="where the level's directory goes")
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.rank
    os.environ["MPICKPT_NODE"] = f"n{rank}"
    n = int(a.gb * 1e9 / 4 / 8)
    state = {f"t{i}": torch.randn(n) for i in range(8)}
    root = comm.bcast(tempfile.mkdtemp(dir="/tmp") if rank == 0 else None)
    local = comm.bcast(tempfile.mkdtemp(dir=a.local) if rank == 0 else None)

    def checkpointer() -> mpickpt.Checkpointer:
        return mpickpt.Checkpointer(root, local=mpickpt.Local(local, redundancy="partner"))

    try:
        ck = checkpointer()
        ck.save(1, state).wait()
        ck.save(2, state).wait()
        ck.close()
        ref = {k: v.clone() for k, v in state.items()}
        ck, times, mapped = checkpointer(), [], 0
        for _ in range(a.reps + 1):
            for v in state.values():
                v.zero_()
            comm.Barrier()
            t = time.perf_counter()
            ck.restore(state)
            comm.Barrier()
            times.append(time.perf_counter() - t)
            bad = [k for k in ref if not torch.equal(ref[k], state[k])]
            if bad:
                raise SystemExit(f"rank {rank}: restored {bad} differ from what was saved")
            assert ck.restore_info is not None
            mapped = getattr(ck.restore_info, "mapped_bytes", 0)
        ck.close()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
    if rank == 0:
        out = {"package": os.path.dirname(mpickpt.__file__), "ranks": comm.size,
               "bytes_per_rank": 8 * 4 * n, "first_s": times[0],
               "median_s": statistics.median(times[1:]), "times_s": times,
               "mapped_bytes_rank0": mapped}
        print(f"{'package':<40} {'GB/rank':>8} {'first s':>8} {'median s':>9} {'mapped':>7}")
        print(f"{out['package'][-40:]:<40} {a.gb:>8.2f} {times[0]:>8.3f} {out['median_s']:>9.3f}"
              f" {mapped / max(8 * 4 * n, 1):>7.0%}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
