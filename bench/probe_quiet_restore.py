"""``bench_levels.py`` with every rank left quiet before each restore: ``gc.collect()``, then 3 s
for the background work of the Checkpointers closed before it (unmapping the level's files,
freeing page-locked memory) to end. A restore in a restarted job starts in a fresh process; this
tells whether the bench's restores, made in the process that trained, pay for what came before.

    mpirun -n 2 --bind-to none python bench/probe_quiet_restore.py --reps 1 --steps 10 \\
        --every 10 --methods local --redundancy partner --timeline --out quiet.json

Arguments are ``bench_levels.py``'s. Each rank prints ``QUIET`` with what ``gc.collect()`` found.
"""

from __future__ import annotations

import gc
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # the module bench_levels.py scrambles its targets with

_scramble = bench_cpu.scramble


def quiet(*args, **kwargs):
    """The target scrambled (every rank, before each restore), then the process left alone."""
    out = _scramble(*args, **kwargs)
    t = time.perf_counter()
    found = gc.collect()
    took = time.perf_counter() - t
    time.sleep(3)
    print(f"QUIET gc.collect found {found} objects in {took * 1e3:.1f} ms, then 3 s",
          file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    bench_cpu.scramble = quiet
    sys.argv = [str(Path(__file__).with_name("bench_levels.py")), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
