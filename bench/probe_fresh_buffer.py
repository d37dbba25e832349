"""A fresh process's first host buffer, as a restarted job's restore gets it: ordinary pages
(``torch.empty``) against huge pages (``mpickpt.save.pinned_pool.host_buffer(huge=True)``),
touched, page-locked untouched (``cudaHostRegister``), and touched then page-locked (what
``HostPool.lock`` does). Each figure in a new process, ``--reps`` times, alternating.

    python bench/probe_fresh_buffer.py --gb 3 --json fresh.json      # prints a table

Without CUDA only the touch is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(pages: str, what: str, gb: float) -> float:
    """In this process: make the buffer, time ``what``."""
    import torch

    sys.path.insert(0, str(ROOT))
    from mpickpt.save.pinned_pool import host_buffer

    n = int(gb * 1e9)
    buf = torch.empty(n, dtype=torch.uint8) if pages == "small" else host_buffer(n, huge=True)
    t = time.perf_counter()
    if what in ("touch", "touch+lock"):
        buf.zero_()
    if what in ("lock", "touch+lock"):
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), n, 0)
        assert int(err) == 0, f"cudaHostRegister error {int(err)}"
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default="probe-fresh-buffer.json")
    ap.add_argument("--one", nargs=2, metavar=("PAGES", "WHAT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(one(*a.one, a.gb))
        return
    import torch

    whats = ["touch", "lock", "touch+lock"] if torch.cuda.is_available() else ["touch"]
    got: dict[str, list[float]] = {}
    for _ in range(a.reps):
        for what in whats:
            for pages in ("small", "huge"):
                out = subprocess.run([sys.executable, __file__, "--gb", str(a.gb), "--one",
                                      pages, what], check=True, capture_output=True, text=True)
                got.setdefault(f"{what}, {pages} pages", []).append(float(out.stdout.split()[-1]))
    width = max(map(len, got))
    print(f"{'a fresh process':{width}}  {'median s':>8}  each ({a.gb:g} GB)")
    for k, v in got.items():
        print(f"{k:{width}}  {statistics.median(v):8.3f}  {', '.join(f'{x:.3f}' for x in v)}")
    with open(a.json, "w") as f:
        json.dump({"gb": a.gb, "cuda": torch.cuda.is_available(), "seconds": got}, f, indent=1)


if __name__ == "__main__":
    main()
