"""Train examples/train.py's model, save at steps 5, 10 and 15, with the save of step 10 made to
fail on rank 1 by a real mechanism; then restore the newest and the oldest checkpoint.

Usage: fault_failed_save.py ROOT MODE REPORTS, where MODE breaks rank 1's shard of step 10:

  raise   the test sets MPICKPT_FAULT=mid-write:1:raise:10 (an exception in the middle of writing)
  dir     a directory named rank-00001.h5 stands in the partial directory (open fails, EISDIR)
  fsize   RLIMIT_FSIZE of rank 1 is 4 KiB during the save (writes fail with EFBIG)
  full    rank 1 fills the file system holding ROOT (a small tmpfs) before the save (ENOSPC)

Each rank writes REPORTS/rank-R.json with every SaveResult, what rank 0 saw under ROOT after the
failed save, and the outcome of both restores (step, and whether the state equals the saved one).

Run by tests/faults/test_fault_failed_save.py.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from pathlib import Path

from mpi4py import MPI

import mpickpt
from mpickpt.format import rootdir
from mpickpt.format.names import shard_name

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from _report import write_report
from fault_restore import fill, image, outcome
from train import make_state, train_step

FAILED = 10


def break_save(mode: str, root: str, ck: mpickpt.Checkpointer):
    """Make rank 1's save of step FAILED fail; return the function that repairs it."""
    if mode == "raise":
        assert os.environ.get("MPICKPT_FAULT") == f"mid-write:1:raise:{FAILED}"
        return lambda: None
    if mode == "dir":
        os.makedirs(os.path.join(root, rootdir.partial_name(FAILED, ck.run_id), shard_name(1)))
        return lambda: None
    if mode == "fsize":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    if mode == "full":
        filler = os.path.join(os.path.dirname(root), "filler")
        fill(filler)
        return lambda: os.unlink(filler)
    raise SystemExit(f"unknown mode {mode!r}")


def main() -> None:
    root, mode, reports = sys.argv[1:4]
    comm = MPI.COMM_WORLD
    rank = comm.rank
    state = make_state(rank, 64)
    ck = mpickpt.Checkpointer(root)
    results, images = {}, {}

    def run(steps: int) -> None:
        for _ in range(steps):
            train_step(state, comm)

    run(5)
    results[5] = ck.save(5, state).wait()
    images[5] = image(state)
    run(5)
    repair = break_save(mode, root, ck) if rank == 1 else (lambda: None)
    comm.Barrier()
    results[FAILED] = ck.save(FAILED, state).wait()
    repair()
    comm.Barrier()
    after_abort = sorted(os.listdir(root)) if rank == 0 else None
    run(5)
    results[15] = ck.save(15, state).wait()
    images[15] = image(state)

    fresh = make_state(rank, 64)
    newest = ck.restore(fresh)
    newest_ok = image(fresh) == images[15]
    fresh = make_state(rank, 64)
    oldest = ck.restore(fresh, step=5)
    oldest_ok = image(fresh) == images[5]
    ck.close()
    write_report(reports, f"rank-{rank}.json", {
        "rank": rank,
        "saves": {s: outcome(r) for s, r in results.items()},
        "after_abort": after_abort,
        "restored": [newest, newest_ok, oldest, oldest_ok],
    })


if __name__ == "__main__":
    main()
