"""Why a node-local save takes longer to be protected while the ranks train: the same save,
idle and beside training loops that differ in one thing each.

Every rank is a simulated node (``$MPICKPT_NODE=n<rank>``) with ``--gb`` of ``bench_levels``'s
MLP + Adam in all, the level in ``/dev/shm`` with partner redundancy. Each variant saves
``--reps`` times (after a warm-up save) and times save() -> protected on the slowest rank, with
the save's own phases (``copy_s``, ``data_s``: the shard's write, ``stream_s`` /
``stream_wait_s``: the partner stream and the wait for it after the write), and the steps'
slowdown. Variants (``--variants``, comma-separated):

- ``idle``: no training beside the save;
- ``train``: ``bench_levels``'s step (forward passes, ``.item()``, an MPI barrier polled with
  sleeps, as a data-parallel step's allreduce);
- ``train-nompi``: the same step without the barrier;
- ``train-switch``: ``train`` with the interpreter's switch interval at 0.5 ms (not 5 ms).

``--priority`` sets mpickpt's background threads' CPU priority for the whole run (see
``mpickpt/background.py``).

    mpiexec -n 2 python bench/probe_protect_training.py --gb 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_levels as bl

import mpickpt

STATS = ("copy_s", "data_s", "persist_s", "stream_s", "stream_wait_s", "protected_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="state in GB, all ranks together")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--variants", default="idle,train,train-nompi,train-switch")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--priority", choices=("build", "all-normal", "all-lowered"),
                    default="build", help="mpickpt's background threads: as the build has them "
                    "(I/O threads at nice +10, the transfer threads not), all at the training "
                    "thread's priority, or all at nice +10 (as before this probe)")
    ap.add_argument("--json", default="probe-protect-training.json")
    a = ap.parse_args()
    os.environ["MPICKPT_NODE"] = f"n{bl.RANK}"
    if a.priority != "build":
        set_priority(a.priority == "all-lowered")
    device = torch_device(a.cpu)
    layers, width = bl.shape(a.gb, None)
    mine = [i for i in range(layers) if i % bl.SIZE == bl.RANK]
    model, optim = bl.build(len(mine), width, 1 + bl.RANK, 1e-3, device)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    work = bl.Workload(model, width, 256, a.step_ms / 1e3, device)
    root = bl.COMM.bcast(tempfile.mkdtemp(dir="/tmp") if bl.RANK == 0 else None)
    local = bl.COMM.bcast(tempfile.mkdtemp(dir="/dev/shm") if bl.RANK == 0 else None)
    ck = mpickpt.Checkpointer(root, local=mpickpt.Local(local, redundancy="partner",
                                                        persist_every=None))
    results: dict[str, dict[str, object]] = {}
    step = 0
    try:
        base = step_time(work, 5)
        for variant in a.variants.split(","):
            step_fn = work_nompi(work) if variant == "train-nompi" else work.step
            sys.setswitchinterval(0.0005 if variant == "train-switch" else 0.005)
            rows, ratios = [], []
            for rep in range(a.reps + 1):
                step += 1
                bl.barrier()
                t = time.perf_counter()
                handle = ck.save(step, state)
                steps, t1 = 0, time.perf_counter()
                if variant != "idle":
                    while not handle.done():
                        step_fn()
                        steps += 1
                result = handle.wait()
                took = time.perf_counter() - t
                if rep:  # the first is a warm-up (files recycled from then on)
                    stats = dict(result.stats)
                    row = {k: bl.slowest(float(stats.get(k, 0.0))) for k in STATS}
                    row["call_to_protected_s"] = bl.slowest(took)
                    rows.append(row)
                    if steps:
                        ratios.append(bl.slowest((time.perf_counter() - t1) / steps) / base)
            results[variant] = {k: statistics.median(r[k] for r in rows)
                                for k in (*STATS, "call_to_protected_s")}
            results[variant]["step_time_over_base"] = statistics.median(ratios) if ratios \
                else None
            bl.say(f"{variant}: " + json.dumps(
                {k: round(v, 3) if v else v for k, v in results[variant].items()}))
    finally:
        ck.close()
        bl.barrier()
        if bl.RANK == 0:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
    if bl.RANK == 0:
        width_ = max(map(len, results))
        cols = ("call_to_protected_s", *STATS[:-1], "step_time_over_base")
        print(f"{'variant':{width_}}  " + "  ".join(f"{c:>19}" for c in cols))
        for v, r in results.items():
            print(f"{v:{width_}}  " + "  ".join(
                f"{r[c]:19.3f}" if r[c] is not None else f"{'-':>19}" for c in cols))
        with open(a.json, "w") as f:
            json.dump({"ranks": bl.SIZE, "gb": a.gb, "device": str(device),
                       "priority": a.priority, "results": results}, f, indent=1)


def set_priority(lowered: bool) -> None:
    """Every background thread mpickpt starts from now on at nice +10, or none."""
    import concurrent.futures
    import functools

    from mpickpt import background
    from mpickpt.format import iothreads
    from mpickpt.local import exchange
    from mpickpt.mpi import protocol

    iothreads.lower_priority = background.lower_priority if lowered else (lambda: None)
    if lowered:  # the partner stream's and the transfer waiter's threads too
        exchange.ThreadPoolExecutor = functools.partial(
            concurrent.futures.ThreadPoolExecutor, initializer=background.lower_priority)
        protocol._WAITER.append(concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mpickpt-transfer", initializer=background.lower_priority))


def torch_device(cpu: bool):
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def work_nompi(work: bl.Workload):
    def step() -> None:
        for _ in range(work.passes):
            y = work._pass()
        y.float().mean().item()
    return step


def step_time(work: bl.Workload, n: int) -> float:
    bl.barrier()
    t = time.perf_counter()
    for _ in range(n):
        work.step()
    return bl.slowest((time.perf_counter() - t) / n)


if __name__ == "__main__":
    main()
