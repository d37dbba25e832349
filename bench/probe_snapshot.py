"""Where a GPU snapshot's stall goes: the training loop's extra time while another thread
(a) makes a page-locked host buffer ready, or (b) empties a device staging buffer into it.

Each case runs the reference job of ``bench_gpu.py`` (one GPU) while a background thread does the
work, and reports how long the work took and how much longer the steps that ran beside it took
than the median step without it (the training loop's loss). Used to choose how ``pinned_pool``
page-locks its buffers and how ``snapshot`` empties the staging buffer::

    python bench/probe_snapshot.py --json bench/results/probe-snapshot.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import Job, add_job_args, baseline_step

from mpickpt.save import landing, pinned_pool


def beside(job: Job, base: float, work: Callable[[], Any]) -> dict[str, float]:
    """Run ``work`` on a thread while the job steps; its time and the steps' extra time."""
    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        try:
            work()
        finally:
            took.append(time.perf_counter() - t)
            done.set()

    torch.cuda.synchronize()
    th = threading.Thread(target=run)
    steps: list[float] = []
    th.start()
    while not done.is_set():
        t = time.perf_counter()
        job.step()
        steps.append(time.perf_counter() - t)
    th.join()
    extra = sum(steps) - len(steps) * base
    return {"work_s": took[0], "steps": len(steps), "extra_s": extra,
            "worst_step_extra_s": max(steps) - base if steps else 0.0}


def save_windows(job: Job, base: float, trace: str) -> dict[str, Any]:
    """The steps right after an mpickpt save (second and later saves), with and without device
    staging; one window under torch.profiler when ``trace`` names a file."""
    import shutil

    import mpickpt

    out: dict[str, Any] = {}
    state = {"model": job.model, "optim": job.opt}
    for staging in (True, False):
        root = "/tmp/probe-snapshot-ck"
        shutil.rmtree(root, ignore_errors=True)
        with mpickpt.Checkpointer(root, keep=1,
                                  snapshots=mpickpt.Snapshots(device_staging=staging)) as ck:
            ck.save(0, state).wait()
            rows = []
            for i in range(1, 4):
                torch.cuda.synchronize()
                h = ck.save(i, state)
                steps = []
                for _ in range(12):
                    t = time.perf_counter()
                    job.step()
                    steps.append(round((time.perf_counter() - t - base) * 1e3, 2))
                h.wait()
                rows.append(steps)
                print(f"save  staging={staging!s:5s} extra ms per step after save(): {steps}",
                      flush=True)
            out[f"staging={staging}"] = rows
            if staging and trace:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    h = ck.save(9, state)
                    for _ in range(8):
                        job.step()
                h.wait()
                prof.export_chrome_trace(trace)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return out


def show(kind: str, name: str, r: dict[str, float]) -> None:
    print(f"{kind:5s} {name:34s} work {r['work_s']:.3f} s  steps {r['steps']:4d}  loop loses "
          f"{r['extra_s']:.3f} s (worst step +{r['worst_step_extra_s'] * 1e3:.1f} ms)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_args(ap)
    ap.add_argument("--json", default="bench/results/probe-snapshot.json")
    ap.add_argument("--trace", default="", help="write a torch.profiler trace of one save here")
    args = ap.parse_args()
    job = Job(args.layers, args.width, args.batch, torch.device("cuda"))
    n = pinned_pool.align(job.nbytes())
    base = baseline_step(job, 30)
    print(f"{n / 1e9:.2f} GB, step {base * 1e3:.1f} ms", flush=True)
    res: dict[str, Any] = {"bytes": n, "step_s": base, "pin": {}, "drain": {}}

    def pin_hostalloc() -> None:
        torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def touch() -> None:
        torch.empty(n, dtype=torch.uint8).fill_(0)

    def pin_pieces(chunk: int, pause: float) -> Callable[[], None]:
        def work() -> None:
            cudart = torch.cuda.cudart()
            buf = torch.empty(n, dtype=torch.uint8)
            ptrs = []
            for off in range(0, n, chunk):
                cudart.cudaHostRegister(buf.data_ptr() + off, min(chunk, n - off), 0)
                ptrs.append(buf.data_ptr() + off)
                time.sleep(pause)
            for p in ptrs:
                cudart.cudaHostUnregister(p)
        return work

    cases: dict[str, Callable[[], None]] = {"cudaHostAlloc": pin_hostalloc,
                                           "pageable, touched": touch}
    for mib in (2, 64):
        cases[f"cudaHostRegister {mib} MiB pieces"] = pin_pieces(mib << 20, 0.0)
    cases["cudaHostRegister 2 MiB, 2 ms pauses"] = pin_pieces(2 << 20, 0.002)
    cases["cudaHostRegister 16 MiB, 20 ms pauses"] = pin_pieces(16 << 20, 0.02)
    for name, work in cases.items():
        r = beside(job, base, work)
        res["pin"][name] = r
        show("pin", name, r)

    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8).fill_(0)
    staging = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for chunk_mib, depth, host in ((4, 1, pinned), (32, 1, pinned), (n >> 20, 1, pinned),
                                   (4, 1, pageable), (64, 1, pageable)):
        def work(c: int = chunk_mib << 20, d: int = depth, h: torch.Tensor = host,
                 src: torch.Tensor = staging) -> None:
            landing.D2H_CHUNK, landing.D2H_DEPTH = c, d
            landing.unstage(stream, src, h)
        name = f"{chunk_mib} MiB x{depth}{'' if host is pinned else ' to pageable'}"
        r = beside(job, base, work)
        res["drain"][name] = r
        show("drain", name, r)
    landing.D2H_CHUNK, landing.D2H_DEPTH = 4 << 20, 1
    del pinned, pageable, staging, work
    res["save"] = save_windows(job, base, args.trace)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
