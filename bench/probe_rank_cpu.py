"""The CPU each rank's process spends per save of a small DDP-like state, saves only, each
waited for: which rank pays for what (rank 0 commits; the writers of the replicated state write
it), for one or more ``Files(min_write_share=)`` in alternation.

    mpiexec -n 4 python bench/probe_rank_cpu.py --dir /tmp/prc --shares 0,16777216 --pairs 2

The state is bench_frequent.py's model and Adam of 2 ``Linear(256, 256)`` (1.6 MB), saved with
``replicated=("model", "optim")``, ``keep=2``; 20 saves warm up, then ``--saves`` are counted
(process CPU from ``getrusage``, all threads). Rank 0 prints a line per rank and the mean, and
writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import torch
from mpi4py import MPI

import mpickpt


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(root: Path, share: int, saves: int, state: dict) -> tuple[float, float]:
    """(process CPU ms per save, wall ms per save) of this rank for ``share``."""
    comm = MPI.COMM_WORLD
    ck = mpickpt.Checkpointer(root, keep=2, replicated=("model", "optim"),
                              files=mpickpt.Files(min_write_share=share))
    for s in range(20):
        ck.save(s, state).wait()
    comm.Barrier()
    c0, w0 = cpu_s(), time.perf_counter()
    for s in range(20, 20 + saves):
        ck.save(s, state).wait()
    cpu, wall = (cpu_s() - c0) / saves * 1e3, (time.perf_counter() - w0) / saves * 1e3
    ck.close()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    comm.Barrier()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/probe-rank-cpu")
    ap.add_argument("--shares", default="0,16777216", help="min_write_share values, a,b,...")
    ap.add_argument("--pairs", type=int, default=2, help="rounds over the shares")
    ap.add_argument("--saves", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    rows = []
    for n in range(args.pairs):
        for share in (int(s) for s in args.shares.split(",")):
            cpu, wall = one(Path(args.dir) / f"r{n}-{share}", share, args.saves, state)
            got = comm.gather(cpu, root=0)
            if comm.rank == 0:
                rows.append({"round": n, "min_write_share": share, "cpu_ms_per_save": got,
                             "mean_ms": sum(got) / len(got), "wall_ms_per_save": wall})
                print(f"round {n} min_write_share={share}: wall {wall:.1f} ms/save; CPU ms/save "
                      f"by rank {', '.join(f'{c:.2f}' for c in got)}; mean "
                      f"{sum(got) / len(got):.2f}", flush=True)
    if comm.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"ranks": comm.size, "saves": args.saves,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
