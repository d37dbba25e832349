"""Replicated (DDP) state on one node: every rank reads it, or one reads it and shares it?

    mpiexec -n 4 python bench/bench_replicated.py --gb 2 --dir /tmp/rep

A DDP-like state (``--gb`` GB of float32 tensors, ``Checkpointer(replicated=("model",))``) is
saved once by all ranks (each tensor written once). Then, with the page cache dropped before
each (when root may), two ways to bring it back on every rank of the node are timed, barrier to
barrier, ``--rounds`` times in alternation:

- ``every rank reads``: ``Checkpointer.restore`` on all ranks (what mpickpt does);
- ``one reads, shares``: the node's first rank restores it alone (a Checkpointer on
  ``MPI.COMM_SELF``: the same reads, once), then an ``MPI_Bcast`` over the node's ranks copies
  every tensor into the others' memory (shared-memory transport).

Prints a table (median and best of the rounds) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_gpu import drop_caches  # bench/ is sys.path[0]
from mpi4py import MPI

import mpickpt

HERE = Path(__file__).resolve().parent


def make(gb: float, fill: float | None) -> dict:
    n = 64
    per = int(gb * 1e9 / 4 / n)
    g = torch.Generator().manual_seed(5)
    return {"model": {f"w{i}": (torch.randn(per, generator=g) if fill is None
                                else torch.full((per,), fill)) for i in range(n)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/mpickpt-bench-replicated")
    ap.add_argument("--json", default=str(HERE / "results" / "replicated.json"))
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    root = Path(args.dir)
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    world.Barrier()
    saved = make(args.gb, None)
    ck = mpickpt.Checkpointer(root, replicated=("model",))
    assert ck.save(1, saved).wait().committed
    times: dict[str, list[float]] = {"every rank reads": [], "one reads, shares": []}
    dropped = []
    for _ in range(args.rounds):
        for way in times:
            state = make(args.gb, 0.0)
            if world.rank == 0:
                dropped.append(drop_caches())
            world.Barrier()
            t = time.perf_counter()
            if way == "every rank reads":
                assert ck.restore(state) == 1
            else:
                if node.rank == 0:
                    alone = mpickpt.Checkpointer(root, MPI.COMM_SELF, replicated=("model",))
                    assert alone.restore(state) == 1
                    alone.close()
                for v in state["model"].values():
                    node.Bcast(v.numpy(), root=0)
            world.Barrier()
            times[way].append(time.perf_counter() - t)
            assert all(torch.equal(state["model"][k], saved["model"][k]) for k in saved["model"])
    ck.close()
    if world.rank == 0:
        gb = sum(v.numel() * 4 for v in saved["model"].values()) / 1e9
        print(f"replicated state {gb:.2f} GB restored on {world.size} ranks of one node "
              f"(page cache dropped: {all(dropped)})")
        print(f"{'way':<20} {'median s':>9} {'best s':>7}")
        for way, ts in times.items():
            print(f"{way:<20} {statistics.median(ts):>9.2f} {min(ts):>7.2f}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"gb": gb, "ranks": world.size, "times": times,
                                               "caches_dropped": dropped}, indent=1))
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
