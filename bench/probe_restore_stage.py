"""Where a restore from ROOT into a state on the GPU spends its time before and after the read.

Saves a model and its Adam state (29 x Linear(4096, 4096): 5.84 GB, on one GPU) once, then
restores it with the page cache dropped, through GPU room and through host memory
(``MPICKPT_RESTORE_GPU_ROOM`` 1, 0, 1), printing ``restore_info.phases`` of each and, with
``--profile``, the calls that took longest (cProfile).

    python bench/probe_restore_stage.py --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import time

import torch
from bench_gpu import drop_caches  # (bench/ is this script's folder: on sys.path)

import mpickpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/probe-restore-stage")
    ap.add_argument("--layers", type=int, default=29)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rooms", default="1,0,1", help="MPICKPT_RESTORE_GPU_ROOM of each restore")
    ap.add_argument("--profile", action="store_true", help="print the longest calls of each")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    shutil.rmtree(args.dir, ignore_errors=True)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                              for _ in range(args.layers)]).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    m(torch.randn(64, args.width, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    state = {"model": m, "optim": opt}
    try:
        with mpickpt.Checkpointer(args.dir, keep=1) as ck:
            ck.save(0, state).wait()
            for room in args.rooms.split(","):
                os.environ["MPICKPT_RESTORE_GPU_ROOM"] = room
                dropped = drop_caches()
                pr = cProfile.Profile()
                t = time.perf_counter()
                if args.profile:
                    pr.enable()
                ck.restore(state)
                torch.cuda.synchronize()
                pr.disable()
                took = time.perf_counter() - t
                info = ck.restore_info
                print(f"=== room {room}: {took:.3f} s, phases "
                      + ", ".join(f"{k} {v:.3f}" for k, v in info.phases.items())
                      + f"; room_bytes {info.room_bytes}, page cache dropped: {dropped}")
                if args.profile:
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28)
                    print("\n".join(ln[:160] for ln in s.getvalue().splitlines()[6:]
                                    if ln.strip()))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
