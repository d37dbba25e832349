"""How long a thread that needs the interpreter's lock waits while a compressed save persists:
a thread running small torch ops in batches (a stand-in for a training loop's Python) times
each batch while the reference job's state, on the CPU, is saved raw, compressed (with zstd's
library into reused buffers), and compressed through ``zstandard``'s API (a new ``bytes`` per
frame, unmapped while holding the lock when freed: the way before mpickpt loaded the library).

    python bench/probe_zstd_gil.py --layers 4 --width 4096 --saves 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import Job

import mpickpt
from mpickpt.format import zstdlib


class Batches:
    """A thread timing batches of small torch ops: (start, seconds) of each."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="batches")

    def _run(self) -> None:
        x = torch.randn(64, 64)
        while not self._stop:
            t = time.perf_counter()
            for _ in range(20):
                x = x * 0.5 + 1
            self.times.append((t, time.perf_counter() - t))

    def between(self, a: float, b: float) -> list[float]:
        return [d for t, d in self.times if a <= t <= b]

    def __enter__(self) -> Batches:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    job = Job(args.layers, args.width, 16, torch.device("cpu"))
    state = {"model": job.model, "optim": job.opt}
    real = zstdlib.lib
    out: dict[str, Any] = {"bytes": job.nbytes(), "rows": {}}
    with Batches() as fg:
        time.sleep(0.5)
        base = statistics.median(d for _, d in fg.times)
        for mode in ("raw", "zstd", "zstd, zstandard", "raw", "zstd", "zstd, zstandard"):
            zstdlib.lib = (lambda: None) if mode.endswith("zstandard") else real
            root = tempfile.mkdtemp(prefix="probe-zgil-", dir=args.dir)
            enc = mpickpt.Encoding(compression=None if mode == "raw" else "zstd")
            ck = mpickpt.Checkpointer(root, keep=2, io_threads=args.io_threads, encoding=enc)
            try:
                for s in range(args.saves):
                    t0 = time.perf_counter()
                    ck.save(s, state).wait()
                    t1 = time.perf_counter()
                    d = fg.between(t0, t1)
                    row = out["rows"].setdefault(mode, [])
                    row.append({"persist_s": t1 - t0, "batches": len(d),
                                "mean_ms": 1e3 * statistics.fmean(d), "max_ms": 1e3 * max(d),
                                "over_4x_median": sum(x > 4 * base for x in d)})
                    r = row[-1]
                    print(f"{mode:18s} save {s}: persisted in {r['persist_s']:.2f} s; batches "
                          f"{r['batches']}, mean {r['mean_ms']:.3f} ms, max {r['max_ms']:.2f} ms,"
                          f" {r['over_4x_median']} over 4x the median", flush=True)
            finally:
                ck.close()
                zstdlib.lib = real
                shutil.rmtree(root, ignore_errors=True)
    print(f"{job.nbytes() / 1e9:.2f} GB on the CPU; a batch alone: median {1e3 * base:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
