"""What building a shard's HDF5 template costs a save's thread (the first save of a layout).

A save lays out a new layout's metadata twice through h5py to make its template
(:mod:`mpickpt.format.h5template`), under the interpreter's lock, on the persist thread. This
probe times :func:`~mpickpt.format.h5template.build` for ``--tensors`` tensors (default 432: a
GPT-2 of 6 layers with Adam's two moments, ``bench_frameworks.py``'s Trainer job), and, in the
same run, one layout through h5py alone (what a save without a template pays), on the thread's
CPU clock and the wall clock; medians of ``--reps``::

    python bench/probe_template.py --json probe-template.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from mpickpt.format import h5template
from mpickpt.format.h5image import MetadataImage
from mpickpt.format.h5layout import Layout

ALIGN, BLOCK = 4096, 1 << 22


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Medians of ``fn``'s thread CPU and wall seconds over ``reps`` calls (one untimed first)."""
    fn()
    cpu, wall = [], []
    for _ in range(reps):
        c, w = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=432)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tensors = {f"model/h.{i}/weight": torch.empty((512, 512), device="meta")
               for i in range(args.tensors)}
    attrs: dict[str, str | int] = {"step": 10, "tree": json.dumps({k: 1 for k in tensors})}

    def one_layout() -> None:
        layout = Layout(MetadataImage(), alignment=ALIGN)
        layout.add(tensors, attrs)
        for r in layout.records:
            r.checksums = ["0" * 16]
        layout.seal()

    def build() -> None:
        if h5template.build(tensors, attrs, alignment=ALIGN, block=BLOCK) is None:
            raise SystemExit("no template for this layout")

    rows = {"one layout through h5py": timed(one_layout, args.reps),
            "build (two layouts, the search, a render)": timed(build, args.reps)}
    print(f"{args.tensors} tensors, medians of {args.reps}")
    for name, (cpu, wall) in rows.items():
        print(f"  {name:44s} {cpu * 1e3:8.1f} ms CPU {wall * 1e3:8.1f} ms wall")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"tensors": args.tensors, "reps": args.reps,
                       "rows": {k: {"cpu_s": c, "wall_s": w} for k, (c, w) in rows.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
