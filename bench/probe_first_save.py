"""What a first save pays on a GPU: MPI's start, the Checkpointer's construction, the first
``save()`` (profiled), and a later one, for the state of ``bench_frameworks.py``'s Lightning
job (an MLP of ``--layers`` x Linear(``--width``), AdamW) saved as Lightning's dict, without
Lightning. ``--mpi-first`` starts MPI before the Checkpointer, apart (as Lightning's
environment detection does); without it the Checkpointer's construction starts MPI::

    python bench/probe_first_save.py --mpi-first    # one GPU; prints timings and the profile

Found (one H200, s65): the first save's copy stream, the first taken from PyTorch's stream
pool, cost 0.12 s there; the Checkpointer now makes it when CUDA is in use already.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

import torch
from torch import nn

from mpickpt.checkpointer import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mpi-first", action="store_true", help="start MPI before the Checkpointer")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    net = nn.Sequential(*[m for _ in range(args.layers)
                          for m in (nn.Linear(args.width, args.width), nn.ReLU())]).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randn(args.width, args.width, device="cuda")

    def step() -> None:
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()

    def state(n: int) -> dict:
        return {"lightning": {"state_dict": net.state_dict(), "optimizer_states":
                              [opt.state_dict()], "global_step": n}}

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.mpi_first:
        t = time.perf_counter()
        from mpi4py import MPI
        MPI.COMM_WORLD.Get_rank()
        print(f"MPI's start: {time.perf_counter() - t:.3f} s")
    t = time.perf_counter()
    ck = Checkpointer(tempfile.mkdtemp(dir=args.dir, prefix="first-save-"), keep=2)
    print(f"Checkpointer(): {time.perf_counter() - t:.3f} s")
    step()
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    ck.save(5, state(5))
    first = time.perf_counter() - t
    prof.disable()
    ck.wait()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    ck.save(10, state(10))
    print(f"first save() {first:.3f} s, a later one {time.perf_counter() - t:.3f} s")
    ck.close()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
