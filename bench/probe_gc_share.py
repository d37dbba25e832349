"""How much of a save of a state with many tensors is Python's garbage collector (CPU, one
process, no MPI launcher): the same saves with the collector on and off, alternating.

    python bench/probe_gc_share.py --layers 1000 --saves 10 --rounds 2 --out gc-share.json

The state: ``--layers`` ``Linear(16, 16)`` layers and their Adam state (8 tensors a layer). Each
save is waited for before the next (``save().wait()``), so a row's time is the whole pipeline's
on this process's threads; with the collector on, the collections that ran (by generation, and
their time, from ``gc.callbacks``) are counted. A full collection (generation 2) holds the
interpreter's lock, so a training thread beside the save waits for it.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from typing import Any

os.environ.setdefault("MPICKPT_LOG", "WARNING")  # (a line per commit otherwise)
from small_layers import small_layers, write_rows

import mpickpt


def run(ck: mpickpt.Checkpointer, state: Any, first: int, saves: int, collect: bool
        ) -> dict[str, Any]:
    spans: list[tuple[int, float]] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spans.append((info["generation"], time.perf_counter() - began[0]))

    gc.collect()
    gc.callbacks.append(timed)
    if not collect:
        gc.disable()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        for step in range(first, first + saves):
            ck.save(step, state()).wait()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()
        gc.callbacks.remove(timed)
    full = [s for g, s in spans if g == 2]
    return {"gc": collect, "s_per_save": wall / saves, "cpu_s_per_save": cpu / saves,
            "full_gcs": len(full), "full_gc_s": sum(full), "collections": len(spans),
            "gc_s": sum(s for _, s in spans), "tracked": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/gc-share.json")
    a = ap.parse_args()
    model, opt, tensors = small_layers(a.layers)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    root = tempfile.mkdtemp(prefix="mpickpt-gc-share-")
    rows: list[dict[str, Any]] = []
    try:
        with mpickpt.Checkpointer(root, keep=2) as ck:
            step = 1
            ck.save(step, state()).wait()  # the first save's buffers and caches
            for r in range(a.rounds):
                for collect in (True, False) if r % 2 == 0 else (False, True):
                    step += 1
                    rows.append({"round": r + 1, **run(ck, state, step, a.saves, collect)})
                    step += a.saves
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{tensors} tensors ({a.layers} x Linear(16, 16) + Adam), {a.saves} saves a row, "
          "each waited for")
    print(f"{'round':>5} {'collector':>9} {'s/save':>7} {'CPU s/save':>10} {'full GCs':>8} "
          f"{'their s':>7} {'all GC s':>8} {'tracked':>8}")
    for x in rows:
        print(f"{x['round']:>5} {'on' if x['gc'] else 'off':>9} {x['s_per_save']:>7.3f} "
              f"{x['cpu_s_per_save']:>10.3f} {x['full_gcs']:>8} {x['full_gc_s']:>7.2f} "
              f"{x['gc_s']:>8.2f} {x['tracked']:>8,}")
    write_rows(a.out, a, tensors, rows)


if __name__ == "__main__":
    main()
