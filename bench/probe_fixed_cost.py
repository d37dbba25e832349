"""The CPU a save of a tiny state costs each rank, and where it goes: no training, only saves.

Each rank saves the model and Adam state of ``bench_frequent.py``'s job (2 x Linear(256, 256),
1.6 MB; ``replicated``, ``keep=2``) ``--saves`` times, waiting for each, after 5 not counted.
It prints each rank's process CPU per save (all its threads, ``getrusage``), and for ranks 0
and 1 the CPU time of the calling thread inside each of :data:`PARTS` per call
(``time.thread_time``: a part's work on other threads is not in it; parts nest, so they do not
add up). Issue 31's goal: at most 2 ms of CPU per save per rank.

    mpiexec -n 4 python bench/probe_fixed_cost.py [--saves 100] [--dir /tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

import mpickpt

PARTS = [("mpickpt.checkpointer", "Checkpointer.save"), ("mpickpt.save.capture", "Capture.take"),
         ("mpickpt.save.snapshot", "Snapshotter.take"), ("mpickpt.save.pipeline", "Pipeline._save"),
         ("mpickpt.save.rootstore", "RootStore.write"),
         ("mpickpt.save.rootstore", "RootStore.publish"),
         ("mpickpt.save.rootstore", "RootStore.retain"),
         ("mpickpt.format.manifest", "Manifest.assemble"),
         ("mpickpt.format.manifest", "Manifest.to_json"), ("mpickpt.format.commit", "publish"),
         ("mpickpt.format.rootdir", "retire"), ("mpickpt.mpi.protocol", "Protocol.complete")]
CPU: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()


def timed(module: str, qualname: str) -> None:
    """Add the calling thread's CPU time in every call of ``module.qualname`` to :data:`CPU`."""
    owner: Any = importlib.import_module(module)
    *path, name = qualname.split(".")
    for p in path:
        owner = getattr(owner, p)
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU[qualname] += time.thread_time() - t
            CALLS[qualname] += 1

    setattr(owner, name, call)


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--dir", default=None, help="where ROOT goes (a new directory in it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    root = comm.bcast(tempfile.mkdtemp(prefix="probe-fixed-", dir=args.dir) if rank == 0
                      else None, 0)
    for module, qualname in PARTS:
        timed(module, qualname)
    ck = mpickpt.Checkpointer(root, keep=2, replicated=("model", "optim"))
    state = {"model": model, "optim": opt}
    for i in range(5):
        ck.save(i, state).wait()
    CPU.clear()
    CALLS.clear()
    comm.Barrier()
    c0, w0 = cpu_s(), time.perf_counter()
    for i in range(5, 5 + args.saves):
        ck.save(i, state).wait()
    per_save = (cpu_s() - c0) / args.saves * 1e3
    wall = (time.perf_counter() - w0) / args.saves * 1e3
    ck.close()
    mine = {q: CPU[q] / CALLS[q] * 1e3 for q in CPU if CALLS[q]}
    got = comm.gather({"cpu_ms": per_save, "wall_ms": wall, "parts_ms": mine}, 0)
    if rank != 0:
        return
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    print(f"{len(got)} ranks, {args.saves} saves each of a 1.6 MB state (waited for each)")
    print(f"{'rank':>4}  {'CPU ms per save':>15}  {'wall ms per save':>16}")
    for r, g in enumerate(got):
        print(f"{r:>4}  {g['cpu_ms']:15.2f}  {g['wall_ms']:16.1f}")
    print("\nthe calling thread's CPU per call, ms (parts nest)")
    shown = [r for r in (0, 1) if r < len(got)]
    print(f"{'part':28s}" + "".join(f"  {'rank ' + str(r):>8}" for r in shown))
    for _, q in PARTS:
        print(f"{q:28s}" + "".join(f"  {got[r]['parts_ms'].get(q, 0.0):8.3f}" for r in shown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"saves": args.saves, "ranks": got}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
