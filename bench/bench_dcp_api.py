"""mpickpt.dcp against torch.distributed.checkpoint: the same calls on the same state, one run.

    torchrun --standalone --nproc-per-node 1 bench/bench_dcp_api.py --gb 2 --reps 3 --dir /tmp/bd
    mpiexec -n 2 python bench/bench_dcp_api.py --gb 0.2 --reps 3 --dir /tmp/bd

Every rank holds ``--gb / ranks`` GB of float32 tensors under keys of its own (on the GPU when
there is one), as a model sharded over the ranks. For each library, ``--reps`` rounds of, in a
shuffled order of the libraries per round:

- ``save``: ``save(state, checkpoint_id=DIR/lib/save-K)``, until it returns (committed, durable);
- ``async_save``: the call (the training's stall), then ``future.result()`` (until durable), into
  ``DIR/lib/async-K``; the next round waits for it first, as DCP asks;
- ``load``: ``load(state, checkpoint_id=DIR/lib/save-K)`` into the live tensors (page cache
  dropped first where root may, else warm); then the round's two checkpoints are removed.

Rank 0 prints a table (median of the rounds, each the slowest rank's; mpickpt's over DCP's as a
ratio) and writes ``--json``. Under torchrun, mpickpt's protocol runs over its own gloo groups;
DCP uses the default group (gloo on the CPU, nccl on the GPU) that this script initialises.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import drop_caches

import mpickpt
import mpickpt.dcp as mdcp

HERE = Path(__file__).resolve().parent
LIBS = {"dcp": tdcp, "mpickpt.dcp": mdcp}


def init() -> tuple[int, int, torch.device]:
    """The default process group (over MPI's ranks when under mpiexec), and this rank's device."""
    if mpickpt.backend() == "mpi":
        from mpi4py import MPI

        from mpickpt.run import set_torch_env, torch_env

        set_torch_env(torch_env(MPI.COMM_WORLD))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def make(rank: int, world: int, gb: float, dev: torch.device) -> dict[str, Any]:
    n = 32
    per = max(1, int(gb * 1e9 / world / 4 / n))
    g = torch.Generator().manual_seed(rank)
    return {"model": {f"rank{rank}.w{i}": torch.randn(per, generator=g).to(dev)
                      for i in range(n)}}


def timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=GLOO[0])
    return float(took)


GLOO: list[Any] = []


def one_round(name: str, state: dict[str, Any], root: Path, k: int,
              t: dict[str, list[float]]) -> None:
    """save, async_save (the call, then until durable), load: one library, round ``k``."""
    lib = LIBS[name]
    t["save"].append(timed(lambda: lib.save(state, checkpoint_id=str(root / name / f"save-{k}"))))
    box: list[Any] = []
    t0 = time.perf_counter()
    t["async_save call"].append(timed(lambda: box.append(lib.async_save(
        state, checkpoint_id=str(root / name / f"async-{k}")))))
    box[0].result()
    t["async_save to durable"].append(time.perf_counter() - t0)
    drop_caches()
    t["load"].append(timed(lambda: lib.load(state, checkpoint_id=str(root / name / f"save-{k}"))))
    if lib is mdcp:  # its Checkpointers of the round's ids close before their directories go
        mdcp.close()
    dist.barrier()
    if dist.get_rank() == 0:  # a round's checkpoints go: a few rounds of GBs fill a disk
        for kind in ("save", "async"):
            shutil.rmtree(root / name / f"{kind}-{k}", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size of the whole job")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/mpickpt-bench-dcp-api")
    ap.add_argument("--json", default=str(HERE / "results" / "dcp-api.json"))
    args = ap.parse_args()
    rank, world, dev = init()
    GLOO.append(dist.new_group(backend="gloo"))
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    state = make(rank, world, args.gb, dev)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    times: dict[str, dict[str, list[float]]] = {
        lib: {"save": [], "async_save call": [], "async_save to durable": [], "load": []}
        for lib in LIBS}
    futures: dict[str, Any] = {}
    order = list(LIBS)
    for k in range(args.reps):
        random.Random(k).shuffle(order)
        for name in order:
            if futures.get(name) is not None:
                futures[name].result()
            one_round(name, state, root, k, times[name])
    mdcp.close()
    if rank == 0:
        rows = {n: {m: statistics.median(v) for m, v in t.items()} for n, t in times.items()}
        gb = nbytes * world / 1e9
        print(f"\n{gb:.2f} GB on {world} rank(s), {dev.type}; median of {args.reps} rounds, "
              f"seconds (slowest rank)")
        print(f"{'':24}" + "".join(f"{n:>14}" for n in LIBS) + f"{'ratio':>10}")
        for m in rows["dcp"]:
            a, b = rows["dcp"][m], rows["mpickpt.dcp"][m]
            print(f"{m:24}{a:14.3f}{b:14.3f}{b / a:10.3f}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "gb": gb, "ranks": world, "device": dev.type, "reps": args.reps,
            "torch": torch.__version__, "medians": rows, "all": times}, indent=1))
        print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
