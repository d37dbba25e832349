"""Which of a save's background steps slows the training loop: each slow step, with where the
save's threads were when it ended.

``bench_gpu.py`` gives a save's stall as one number; with compression (``mpickpt+zstd``) nearly
all of it is one step about 3 s after ``save()``, 0.13-0.19 s longer than the others. This probe
runs the same job (``bench_gpu.Job``) and saves it with a Checkpointer every ``--every`` steps;
each step that takes ``--slow`` times the median or more is printed with its start (from the
save call), its extra time and the innermost Python frames of every other thread, read as soon
as the step ended: a thread that held the interpreter's lock through the step has only just let
it go, so it is still where it held it. Also how much the process's resident memory grew during
each save (sampled every 5 ms).

    python bench/probe_slow_steps.py --compression zstd --json bench/results/probe-slow-steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import Job, add_job_args, baseline_step

import mpickpt


def others(depth: int) -> list[str]:
    """The innermost ``depth`` frames of every thread but this one, one line per thread."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for tid, frame in sys._current_frames().items():
        if tid == me:
            continue
        stack = traceback.extract_stack(frame)[-depth:]
        where = " <- ".join(f"{os.path.basename(s.filename)}:{s.name}:{s.lineno}"
                            for s in reversed(stack))
        out.append(f"{names.get(tid, tid)}: {where}")
    return sorted(out)


def rss() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The most resident bytes seen, sampled every 5 ms on a thread of its own."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_args(ap)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--compression", default=None, help="zstd, zstd+shuffle (default: none)")
    ap.add_argument("--slow", type=float, default=1.5, help="a slow step: this many medians")
    ap.add_argument("--depth", type=int, default=3, help="frames per thread")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="bench/results/probe-slow-steps.json")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    job = Job(a.layers, a.width, a.batch, device)
    base = baseline_step(job, 30)
    root = tempfile.mkdtemp(dir=a.dir, prefix="probe-slow-")
    enc = mpickpt.Encoding(compression=a.compression)
    ck = mpickpt.Checkpointer(root, keep=2, encoding=enc)
    print(f"{job.nbytes() / 1e9:.2f} GB on {device}, step {base * 1e3:.1f} ms, "
          f"compression {a.compression}", flush=True)
    saves: list[dict[str, Any]] = []
    try:
        for i in range(a.saves + 1):  # the first is the warm-up
            job.step()
            job.sync()
            before, watch = rss(), PeakRss()
            t0 = time.perf_counter()
            h = ck.save(i, job.state_dict())
            call = time.perf_counter() - t0
            steps, slow, done_at = [], [], None
            while done_at is None or len(steps) < 10 or time.perf_counter() - done_at < 0.5:
                t = time.perf_counter()
                job.step()
                job.sync()
                dt = time.perf_counter() - t
                if dt > a.slow * base:
                    slow.append({"at_s": round(t - t0, 4), "extra_s": round(dt - base, 4),
                                 "threads": others(a.depth)})
                steps.append(dt)
                if done_at is None and h.done():
                    done_at = time.perf_counter()
            h.wait()
            grew = watch.stop() - before
            stats = {k: v for k, v in h.outcome().stats.items() if isinstance(v, (int, float))}
            extra = sum(s - base for s in steps)
            saves.append({"save": i, "call_s": call, "persist_s": done_at - t0,
                          "extra_s": extra, "slow": slow, "stats": stats,
                          "median_step_s": statistics.median(steps), "rss_growth_bytes": grew})
            print(f"save {i}: call {call:.3f} s, persisted after {done_at - t0:.2f} s, steps "
                  f"+{extra:.3f} s in all, {len(slow)} slow; resident memory grew by at most "
                  f"{grew / 1e6:.0f} MB", flush=True)
            for s in sorted(slow, key=lambda s: -s["extra_s"])[:4]:
                print(f"  step at {s['at_s']:.3f} s: +{s['extra_s']:.3f} s", flush=True)
                for line in s["threads"]:
                    top = line.split(": ", 1)[-1].split(" <- ")[0]
                    if "wait" not in top and ":_worker:" not in top:  # idle threads say nothing
                        print(f"      {line}", flush=True)
    finally:
        ck.close()
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"args": vars(a), "step_s": base, "bytes": job.nbytes(), "saves": saves}, f,
                  indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
