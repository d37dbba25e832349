"""What the training thread pays per ``save()`` for a small state (``bench_frequent.py``'s), alone.

One process, no MPI launcher: the state of ``bench_frequent.py`` (an MLP of ``--layers``
``Linear(width, width)`` layers and its Adam state, 1.6 MB with the defaults) is saved ``--saves``
times after ``--warmup`` saves. Each call is timed on the calling thread's CPU clock
(``time.thread_time``) and on the wall clock; the background write, vote and commit are waited for
after the clock stops, so only the call is measured. In the same run, the same state goes through
``torch.save`` into a reused ``BytesIO`` (serialisation only: no file, no fsync) as the
reference of what building a checkpoint's bytes costs on this thread. To compare two versions of
the package, run it under each with ``PYTHONPATH`` pointing at a checkout::

    OMP_NUM_THREADS=1 python bench/probe_save_call.py --out call.json
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import mpickpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import columns, payload_bytes


def timed(call: Callable[[int], None], after: Callable[[], None], n: int, first: int
          ) -> tuple[list[float], list[float]]:
    """(thread CPU, wall) seconds of ``call(i)`` for ``n`` calls; ``after`` runs untimed."""
    cpu, wall = [], []
    for i in range(first, first + n):
        t0, w0 = time.thread_time(), time.perf_counter()
        call(i)
        cpu.append(time.thread_time() - t0)
        wall.append(time.perf_counter() - w0)
        after()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--saves", type=int, default=300, help="timed calls per method")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dir", default=None, help="ROOT's parent (default: a temp dir in /tmp)")
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, a.width)).sum().backward()
    opt.step()

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    where = tempfile.mkdtemp(dir=a.dir or "/tmp", prefix="probe-save-call-")
    ck = mpickpt.Checkpointer(where, keep=2, replicated=("model", "optim"))
    rows = {}
    try:
        timed(lambda i: ck.save(i, state()), ck.wait, a.warmup, 0)
        rows["mpickpt save()"] = timed(lambda i: ck.save(i, state()), ck.wait, a.saves,
                                       a.warmup)
        buf = io.BytesIO()

        def torch_save(i: int) -> None:
            buf.seek(0)
            buf.truncate()
            torch.save(state(), buf)

        timed(torch_save, lambda: None, a.warmup, 0)
        rows["torch.save to BytesIO"] = timed(torch_save, lambda: None, a.saves, 0)
        ck.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)

    def ms(xs: list[float], q: float) -> float:
        """The ``q`` quantile (a multiple of 0.05) of ``xs``, in ms."""
        return statistics.quantiles(xs, n=20)[round(q * 20) - 1] * 1e3

    table, out = [], {}
    for name, (cpu, wall) in rows.items():
        out[name] = {"thread_cpu_ms": {"median": statistics.median(cpu) * 1e3,
                                       "p10": ms(cpu, 0.1), "p90": ms(cpu, 0.9)},
                     "wall_ms": {"median": statistics.median(wall) * 1e3}}
        table.append((name, f"{out[name]['thread_cpu_ms']['median']:.3f}",
                      f"{out[name]['thread_cpu_ms']['p10']:.3f}",
                      f"{out[name]['thread_cpu_ms']['p90']:.3f}",
                      f"{out[name]['wall_ms']['median']:.3f}"))
    nbytes = payload_bytes((model, opt))
    print(f"one process, {nbytes / 1e6:.2f} MB of model + Adam state, {a.saves} calls each")
    print(columns(("call", "thread CPU ms (median)", "p10", "p90", "wall ms (median)"), table))
    if a.out:
        Path(a.out).write_text(json.dumps({"bytes": nbytes, "saves": a.saves, "rows": out},
                                          indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
