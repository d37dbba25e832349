"""What a save leaves for Python's garbage collector (CPU, one process): how many container
objects the collector tracks are alive while a save is in flight (each survives the young
generations' collections that the training loop's allocations trigger, and counts toward the
next full collection, which holds the interpreter's lock for 0.1-0.4 s in a process with torch
and a model loaded), and how many full collections a loop that allocates like training runs
into, saving every ``--every`` steps, against ``torch.save`` of the same state.

    python bench/probe_gc.py --layers 100 --width 64 --steps 3000 --every 300 --out gc.json

The state: ``--layers`` Linear layers and Adam (4 tensors a layer and a step counter each in
the optimizer); the process also holds ``--resident`` long-lived objects (a loaded framework's).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from typing import Any

import torch
from small_layers import small_layers

import mpickpt
import mpickpt.save.rootstore as rootstore


def tracked_new(before: set[int]) -> list[Any]:
    return [o for o in gc.get_objects() if id(o) not in before]


def in_flight(ck: mpickpt.Checkpointer, state: dict[str, Any], step: int) -> dict[str, Any]:
    """Tracked objects a save created that are alive at its publish (its peak), by type, and
    after it has committed."""
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        seen: list[list[Any]] = []
        publish = rootstore.RootStore.publish

        def counting(self: rootstore.RootStore, *a: Any, **k: Any) -> Any:
            seen.append(tracked_new(before))
            return publish(self, *a, **k)

        rootstore.RootStore.publish = counting  # type: ignore[method-assign]
        try:
            ck.save(step, state).wait()
        finally:
            rootstore.RootStore.publish = publish  # type: ignore[method-assign]
        peak, kinds = len(seen[0]), Counter(type(o).__name__ for o in seen[0]).most_common(6)
        seen.clear()
        after = len(tracked_new(before)) - 1  # (less the list made to count them)
        return {"at_publish": peak, "by_type": kinds, "after_commit": after}
    finally:
        gc.enable()


def loop(method: str, state: dict[str, Any], root: str, steps: int, every: int) -> dict[str, Any]:
    """Steps that allocate short-lived containers (and keep a few), a save every ``every``."""
    full = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    gc.collect()
    ck = mpickpt.Checkpointer(root) if method == "mpickpt" else None
    gc.callbacks.append(count)
    t = time.perf_counter()
    keep: list[Any] = []
    try:
        for s in range(steps):
            made = [{"x": [s, j]} for j in range(200)]
            keep = [*keep[-49:], made[0]]
            if s % every == every - 1:
                if ck is not None:
                    ck.save(s, state)
                elif method == "torch.save":
                    torch.save({k: v.state_dict() for k, v in state.items()}, io.BytesIO())
        if ck is not None:
            ck.wait()
    finally:
        gc.callbacks.remove(count)
    if ck is not None:
        ck.close()
    return {"method": method, "full_gcs": full[0], "s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=300)
    ap.add_argument("--resident", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/gc.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("mpickpt").setLevel(logging.WARNING)
    model, opt, tensors = small_layers(a.layers, a.width)
    state = {"model": model, "optim": opt}
    resident = [{"r": [i]} for i in range(a.resident)]
    tmp = tempfile.mkdtemp(prefix="probe-gc-")
    try:
        ck = mpickpt.Checkpointer(f"{tmp}/peak")
        for i in range(3):  # warm: buffers, the pool of retired files
            ck.save(i, state).wait()
        peak = in_flight(ck, state, 10)
        ck.close()
        rows = []
        for r in range(a.rounds):
            for m in ("none", "torch.save", "mpickpt"):
                shutil.rmtree(f"{tmp}/loop", ignore_errors=True)
                rows.append({**loop(m, state, f"{tmp}/loop", a.steps, a.every), "round": r})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    del resident
    print(f"{tensors} tensors in the state; tracked objects a save made, alive at its publish: "
          f"{peak['at_publish']:,} ({', '.join(f'{k} {n:,}' for k, n in peak['by_type'])}); "
          f"after it committed: {peak['after_commit']:,}")
    print(f"\n{a.steps} steps, a save every {a.every}, {a.resident:,} resident objects")
    print(f"{'method':<12} {'round':>5} {'full GCs':>8} {'loop s':>7}")
    for row in rows:
        print(f"{row['method']:<12} {row['round']:>5} {row['full_gcs']:>8} {row['s']:>7.2f}")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "tensors": tensors, "peak": peak, "rows": rows}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
