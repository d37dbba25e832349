"""A compressed checkpoint's restore against a raw one's: the reference job saved once each way,
then restored ``--reps`` times each with the page cache dropped (where it can be), in place
into the job's tensors. Run it with two builds on ``PYTHONPATH`` to compare them.

    python bench/probe_zstd_restore.py --reps 2 --dir /tmp/bench
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import add_probe_args, drop_caches, probe_job

import mpickpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(ap)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    job, dev = probe_job(args)
    state = {"model": job.model, "optim": job.opt}
    out = {"build": mpickpt.__file__, "bytes": job.nbytes(), "restore_s": {}}
    for comp in ("zstd", None):
        name = comp or "raw"
        root = tempfile.mkdtemp(prefix="probe-zrestore-", dir=args.dir)
        enc = mpickpt.Encoding(compression=comp)
        try:
            ck = mpickpt.Checkpointer(root, keep=2, io_threads=args.io_threads, encoding=enc)
            ck.save(1, state).wait()
            ck.close()
            times = []
            for _ in range(args.reps):
                dropped = drop_caches()
                ck = mpickpt.Checkpointer(root, keep=2, io_threads=args.io_threads, encoding=enc)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                ck.restore(state)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                ck.close()
            out["restore_s"][name] = times
            med = statistics.median(times)
            print(f"{name}: restores {[round(x, 3) for x in times]} s (median {med:.3f} s, "
                  f"{job.nbytes() / med / 1e9:.2f} GB/s of state; page cache dropped: "
                  f"{dropped})", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"build {out['build']}, {job.nbytes() / 1e9:.2f} GB on {dev}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
