"""Restore examples/train.py's state from ROOT into a fresh state and report what happened.

Usage: fault_restore.py ROOT REPORTS [--step S] [--width W]

Each rank writes REPORTS/rank-R.json: the restored step (null when none), restore_info.skipped,
the error raised by restore (if any), and whether the fresh state is still bit-identical to its
initial values ("untouched": model, optimizer, scheduler, data generator, global RNG, losses).

Run by tests/faults/test_fault_corruption.py, tests/faults/test_fault_disk.py and
tests/faults/test_fault_kill.py, to see what a new job restores after a fault: hence a name
for what the fault tests share. The other scenarios that restore train.py's state import
its helpers.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import mpickpt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from _report import write_report
from train import make_state, train_step


def canon(x: object) -> object:
    """A comparable, exact image of a state dict: tensors and arrays as dtype, shape and bytes."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous().reshape(-1)
        return ("tensor", str(x.dtype), tuple(x.shape), t.view(torch.uint8).numpy().tobytes())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tobytes())
    if isinstance(x, dict):
        return ("dict", [(repr(k), canon(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [canon(v) for v in x])
    return ("value", repr(x))


def image(state: dict) -> object:
    return canon({
        "model": state["model"].state_dict(), "optim": state["optim"].state_dict(),
        "sched": state["sched"].state_dict(), "data": state["data"].get_state(),
        "rng": torch.get_rng_state(), "losses": state["losses"],
    })


def fill(path: str, leave: int = 0) -> int:
    """Write ``path`` until its file system is full, then give back ``leave`` bytes; return the
    free bytes (a real full disk for the scenarios that need one)."""
    chunk = b"\xa5" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while chunk:
            try:
                f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
        if leave:
            f.truncate(f.tell() - leave)
        os.fsync(f.fileno())
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def outcome(result: object) -> dict:
    """A SaveResult as a report holds it: every field but the figures."""
    return {k: v for k, v in asdict(result).items() if k != "stats"}  # type: ignore[call-overload]


class Trainer:
    """Five training steps, then a save of ``state`` waited for: each step's result and the
    state's image at it, for the report."""

    def __init__(self, state: dict, comm: object, ck: object) -> None:
        self.state, self.comm, self.ck = state, comm, ck
        self.results: dict[int, object] = {}
        self.images: dict[int, object] = {}

    def __call__(self, step: int) -> None:
        for _ in range(5):
            train_step(self.state, self.comm)
        self.results[step] = self.ck.save(step, self.state).wait()
        self.images[step] = image(self.state)

    def saves(self) -> dict:
        return {s: outcome(r) for s, r in self.results.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("reports")
    ap.add_argument("--step", type=int)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()

    rank = MPI.COMM_WORLD.rank
    state = make_state(rank, args.width)
    before = image(state)
    ck = mpickpt.Checkpointer(args.root)
    step, error = None, None
    try:
        step = ck.restore(state, step=args.step)
    except mpickpt.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    info = ck.restore_info
    ck.close()
    write_report(args.reports, f"rank-{rank}.json", {
        "rank": rank, "step": step, "error": error,
        "skipped": [list(s) for s in info.skipped] if info is not None else None,
        "untouched": image(state) == before,
    })


if __name__ == "__main__":
    main()
