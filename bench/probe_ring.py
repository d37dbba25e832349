"""Why a GPU staging buffer empties through the page-locked ring 5x slower while the job trains.

``bench_gpu.py`` (5.84 GB, pageable pool: no ``prepare()``) lands a snapshot in host memory in
0.3-0.4 s when the loop has stopped and in 0.6-2.5 s while it trains (``copy_s``), and its
persist waits for it. This probe empties a device buffer of the reference job's size into a
pageable host buffer the way ``mpickpt.save.landing`` does (two page-locked pieces: one comes
over from the GPU while the CPU copies the other into place), idle and beside the training loop,
and times each piece's three parts on the emptying thread: queueing the device-to-host copy,
waiting for it (``Event.synchronize``), and the CPU copy into place. Variants: the CPU copy by
torch (as the build), by numpy, by ``ctypes.memmove``; pieces of 16 and 64 MiB. Then, as in a
save, eight writer threads that wait for each 64 MiB block to land and hash it (no disk):
woken at every piece (a ``threading.Condition``'s ``notify_all``, the build before
``Landing`` woke each waiter once) or once per block (``mpickpt.save.landing.Landing``).

    python bench/probe_ring.py --json bench/results/probe-ring.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import Job, add_job_args, baseline_step

from mpickpt.format import checksum, iothreads
from mpickpt.save import landing


def copier(kind: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The CPU copy of a landed piece into place."""
    if kind == "torch":
        return lambda dst, src: dst.copy_(src)
    if kind == "numpy":
        return lambda dst, src: np.copyto(dst.numpy(), src.numpy())
    return lambda dst, src: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


class NotifyAll:
    """``Landing`` as it was: every waiter woken at every piece."""

    def __init__(self, base: int, ranges: list[tuple[int, int]]) -> None:
        self.base, self.ranges = base, ranges
        self._upto = [lo for lo, _ in ranges]
        self._cv = threading.Condition()

    def landed(self, k: int, upto: int) -> None:
        with self._cv:
            self._upto[k] = upto
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        self.landed(0, self.ranges[0][1])

    def gate(self, addr: int, end: int, timeout: float | None = None) -> bool:
        b = end - self.base
        with self._cv:
            return self._cv.wait_for(lambda: self._upto[0] >= min(b, self.ranges[0][1]), timeout)


def with_writers(kind: str, src: torch.Tensor, dst: torch.Tensor, ring: torch.Tensor,
                 stream: torch.cuda.Stream, threads: int = 8) -> dict[str, float]:
    """:func:`drain` while ``threads`` writers wait for each 64 MiB block to land and hash it."""
    make = NotifyAll if kind == "notify-all" else landing.Landing
    gate = make(dst.data_ptr(), [(0, dst.numel())])
    view = memoryview(dst.numpy())
    block = 64 << 20

    def task(_: int, b: int) -> None:
        gate.gate(dst.data_ptr() + b * block, dst.data_ptr() + min((b + 1) * block, dst.numel()))
        checksum.digest(view[b * block:(b + 1) * block])

    tasks = [(0, b) for b in range(-(-dst.numel() // block))]
    batch = iothreads.start_tasks(tasks, task, threads, background=True)
    try:
        out = drain(src, dst, ring, stream, copier("torch"), gate.landed)
    finally:
        gate.finish()
    t = time.perf_counter()
    batch.wait()
    out["writers_after_s"] = time.perf_counter() - t
    return out


def drain(src: torch.Tensor, dst: torch.Tensor, ring: torch.Tensor, stream: torch.cuda.Stream,
          copy: Callable[[torch.Tensor, torch.Tensor], None],
          on_landed: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """landing._unstage_ring with a clock on each part (seconds, summed over the pieces)."""
    half = ring.numel() // 2
    slots = (ring[:half], ring[half:])
    parts = {"queue_s": 0.0, "wait_s": 0.0, "cpu_copy_s": 0.0}
    landed: tuple[torch.cuda.Event, int, int, torch.Tensor] | None = None

    def land(ev: torch.cuda.Event, a: int, b: int, slot: torch.Tensor) -> None:
        t = time.perf_counter()
        ev.synchronize()
        t1 = time.perf_counter()
        copy(dst[a:b], slot[: b - a])
        if on_landed is not None:
            on_landed(0, b)
        parts["wait_s"] += t1 - t
        parts["cpu_copy_s"] += time.perf_counter() - t1

    t0 = time.perf_counter()
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for k, a in enumerate(range(0, src.numel(), half)):
            b = min(a + half, src.numel())
            slot = slots[k % 2]
            t = time.perf_counter()
            slot[: b - a].copy_(src[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            parts["queue_s"] += time.perf_counter() - t
            if landed is not None:
                land(*landed)
            landed = (ev, a, b, slot)
        if landed is not None:
            land(*landed)
    parts["total_s"] = time.perf_counter() - t0
    parts["GBps"] = src.numel() / parts["total_s"] / 1e9
    return parts


def beside(job: Job | None, base: float, work: Callable[[], dict[str, float]]
           ) -> dict[str, float]:
    """``work`` on a thread, with the training loop beside it (``job``) or idle (None)."""
    out: dict[str, float] = {}
    done = threading.Event()

    def run() -> None:
        try:
            out.update(work())
        finally:
            done.set()

    torch.cuda.synchronize()
    th = threading.Thread(target=run)
    steps: list[float] = []
    th.start()
    while job is not None and not done.is_set():
        t = time.perf_counter()
        job.step()
        steps.append(time.perf_counter() - t)
    th.join()
    out["steps"] = len(steps)
    out["loop_extra_s"] = sum(steps) - len(steps) * base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_args(ap)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="only the writers' rows")
    ap.add_argument("--json", default="bench/results/probe-ring.json")
    a = ap.parse_args()
    job = Job(a.layers, a.width, a.batch, torch.device("cuda"))
    n = job.nbytes()
    base = baseline_step(job, 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)  # pageable, touched: as the pool's
    stream = torch.cuda.Stream()
    print(f"{n / 1e9:.2f} GB, step {base * 1e3:.1f} ms, torch threads {torch.get_num_threads()}",
          flush=True)
    rows: list[dict[str, Any]] = []
    for mib in (16, 64) if a.variants else ():
        ring = torch.empty(2 * (mib << 20), dtype=torch.uint8, pin_memory=True)
        for kind in ("torch", "numpy", "memmove"):
            for training in (False, True):
                for rep in range(a.reps):
                    r = beside(job if training else None, base,
                               functools.partial(drain, src, dst, ring, stream, copier(kind)))
                    r.update(piece_MiB=mib, copy=kind, training=training, rep=rep)
                    rows.append(r)
                    print(f"{mib:3d} MiB {kind:8s} {'training' if training else 'idle':8s} "
                          f"{r['total_s']:6.3f} s {r['GBps']:6.2f} GB/s  queue "
                          f"{r['queue_s']:.3f}  wait {r['wait_s']:.3f}  cpu copy "
                          f"{r['cpu_copy_s']:.3f}  steps {r['steps']:3d} loop +"
                          f"{r['loop_extra_s']:.3f} s", flush=True)
    ring = torch.empty(2 * (16 << 20), dtype=torch.uint8, pin_memory=True)
    for kind in ("notify-all", "landing"):
        for training in (False, True):
            for rep in range(a.reps):
                r = beside(job if training else None, base,
                           functools.partial(with_writers, kind, src, dst, ring, stream))
                r.update(piece_MiB=16, copy="torch", writers=kind, training=training, rep=rep)
                rows.append(r)
                print(f"writers woken by {kind:10s} {'training' if training else 'idle':8s} "
                      f"{r['total_s']:6.3f} s {r['GBps']:6.2f} GB/s  wait {r['wait_s']:.3f}  "
                      f"cpu copy {r['cpu_copy_s']:.3f}  writers after "
                      f"{r['writers_after_s']:.3f}  steps {r['steps']:3d} loop +"
                      f"{r['loop_extra_s']:.3f} s", flush=True)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"bytes": n, "step_s": base, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
