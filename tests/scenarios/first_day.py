"""What a new user does on a first day, under ``mpiexec -n N python first_day.py MODE BASE``.
Run by tests/multirank/test_first_day.py. Each rank writes what it saw to
``BASE/out/MODE-rank-R.json``.

Modes:

* ``not-shared``: ranks 0 and 2 are given ``BASE/shared``, every other rank a directory of its
  own (a node-local ROOT): a restore finds nothing and changes nothing; the first save must fail
  on every rank before it writes anything.
* ``no-close``: save steps 1 and 2 and end without ``close()`` (the last save still in flight).
* ``metadata``: a 0-d tensor, a numpy scalar and NaN as metadata commit; an object does not (on
  every rank, or with ``--only-rank R`` on that rank alone), and the next save commits.
* ``other-steps``: steps 1 and 2 saved, then ``restore(step=1)`` on even ranks and ``step=2``
  on odd ones.
* ``replicated-typo``: ``replicated=("modle",)`` is refused at the first save (``typo-no-close``:
  the same, and the script ends without ``close()``).
* ``again``: step 2 saved twice; the second replaces the first, with a warning.
* ``busy``: saves of every step, each slowed down: the log says once that saves wait.
* ``skip``: ``if_busy="skip"``, saves 0.3 s apart while rank 1's writes are slowed down (1 s):
  the saves it has no buffer for are skipped on every rank, and save() never waits.
* ``retention``: ``keep=2, keep_every=4, best=("val", "min"), keep_best=1`` over steps 1..10.
* ``values``: ``mpickpt.Values`` restored in place; ``--restore`` restores, else saves.
* ``early-signal``: rank 1 gets SIGUSR2 before the Checkpointer exists (after ``import
  mpickpt``); the job must checkpoint at its first ``should_exit`` and exit 3.
* ``root-held``: save step 10 into ``BASE/ckpt``, which another process may hold the writer lock
  of; each rank records the refusal it got, or none.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np
import torch
from _report import write_report
from mpi4py import MPI

import mpickpt


def state(rank: int) -> dict:
    torch.manual_seed(rank)
    return {"model": torch.nn.Linear(8, 4), "step": 0}


def record(base: str, mode: str, **what) -> None:
    write_report(os.path.join(base, "out"), f"{mode}-rank-{MPI.COMM_WORLD.rank}.json", what)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("base")
    ap.add_argument("--only-rank", type=int)
    ap.add_argument("--restore", action="store_true")
    a = ap.parse_args()
    rank = MPI.COMM_WORLD.rank
    root = os.path.join(a.base, "ckpt")
    st = state(rank)

    if a.mode == "not-shared":
        root = os.path.join(a.base, "shared" if rank in (0, 2) else f"own-{rank}")
        os.makedirs(root, exist_ok=True)
        ckpt = mpickpt.Checkpointer(root)
        start = ckpt.restore(st)
        try:
            ckpt.save(1, st)
        except mpickpt.RootNotSharedError as e:
            record(a.base, a.mode, error=str(e), start=start)
            return
        record(a.base, a.mode, error=None, start=start)

    elif a.mode == "no-close":
        ckpt = mpickpt.Checkpointer(root)
        ckpt.save(1, st).wait()
        time.sleep(0.05 * rank)
        ckpt.save(2, st)  # in flight when the script ends, and no close()
        record(a.base, a.mode, ended=True)

    elif a.mode == "metadata":
        ckpt = mpickpt.Checkpointer(root)
        good = {"loss": torch.tensor(0.25), "acc": np.float32(0.5), "n": np.int64(7),
                "bad_run": float("nan"), "tags": ["a", 1], "lr": 1e-3}
        first = ckpt.save(1, st, metadata=good).wait()
        error = None
        bad = {"loss": 0.1, "opt": {"sched": object()}}
        try:
            ckpt.save(2, st, metadata=bad if a.only_rank in (None, rank) else {"loss": 0.1})
        except mpickpt.MetadataError as e:
            error = str(e)
        second = ckpt.wait()
        third = ckpt.save(3, st, metadata={"loss": torch.tensor([0.5])[0]}).wait()
        ckpt.close()
        ckpt = mpickpt.Checkpointer(root)
        ckpt.restore(state(rank), step=1)
        record(a.base, a.mode, first=first.committed, metadata=first.metadata, error=error,
               second=[r.committed for r in second], third=third.committed,
               restored=ckpt.restore_info.metadata, seconds=ckpt.restore_info.seconds,
               bytes=ckpt.restore_info.bytes_read, total=ckpt.restore_info.total_bytes_read)
        ckpt.close()

    elif a.mode == "other-steps":
        ckpt = mpickpt.Checkpointer(root)
        for step in (1, 2):
            ckpt.save(step, st).wait()
        t0, error = time.monotonic(), None
        try:
            ckpt.restore(state(rank), step=1 + rank % 2)
        except mpickpt.CheckpointError as e:
            error = str(e)
        ckpt.close()
        record(a.base, a.mode, error=error, seconds=time.monotonic() - t0)

    elif a.mode in ("replicated-typo", "typo-no-close"):
        ckpt = mpickpt.Checkpointer(root, replicated=("modle",))
        try:
            ckpt.save(1, st)
            error = None
        except mpickpt.StateTreeError as e:
            error = str(e)
        if a.mode == "replicated-typo":
            ckpt.close()
        record(a.base, a.mode, error=error)

    elif a.mode == "again":
        ckpt = mpickpt.Checkpointer(root)
        ckpt.save(2, st).wait()
        st["step"] = 99
        ckpt.save(2, st).wait()
        ckpt.close()
        record(a.base, a.mode)

    elif a.mode == "busy":
        ckpt = mpickpt.Checkpointer(root, keep=2)
        for step in range(1, 7):
            ckpt.save(step, st)
        ckpt.wait()
        time.sleep(0.1)
        ckpt.save(7, st).wait()
        ckpt.close()
        record(a.base, a.mode)

    elif a.mode == "skip":
        ckpt = mpickpt.Checkpointer(root, keep=10, on_error="raise",
                                    snapshots=mpickpt.Snapshots(if_busy="skip"))
        handles, calls = [], []
        for step in range(1, 7):
            t = time.perf_counter()
            handles.append(ckpt.save(step, st))
            calls.append(time.perf_counter() - t)
            time.sleep(0.3)
        outcomes = [(h.step, h.wait().committed, h.wait().skipped) for h in handles]
        ckpt.wait()
        last = ckpt.save(7, st).wait()
        ckpt.close()
        record(a.base, a.mode, outcomes=outcomes, calls=calls, last=last.committed)

    elif a.mode == "retention":
        kept = mpickpt.Retention(2, keep_every=4, best=("val", "min"), keep_best=1)
        ckpt = mpickpt.Checkpointer(root, keep=kept)
        vals = {1: 0.9, 2: 0.8, 3: 0.3, 4: 0.7, 5: 0.6, 6: 0.5, 7: 0.4, 8: 0.35, 9: 0.5, 10: 0.6}
        after = {}
        for step in range(1, 11):
            ckpt.save(step, st, metadata={"val": vals[step]}).wait()
            after[step] = sorted(int(n[5:]) for n in os.listdir(root)
                                 if n.startswith("step-") and "." not in n)
        ckpt.close()
        record(a.base, a.mode, after=after)

    elif a.mode == "early-signal":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        ckpt = mpickpt.Checkpointer(root, preemption=mpickpt.Preemption(requeue=False))
        for step in range(3):
            record(a.base, a.mode, last=step)
            ckpt.should_exit(step + 1, st)

    elif a.mode == "root-held":
        ckpt = mpickpt.Checkpointer(root)
        try:
            ckpt.save(10, st).wait()
        except mpickpt.RootInUseError as e:
            record(a.base, a.mode, refused=str(e))
            ckpt.close()
            return
        ckpt.close()
        record(a.base, a.mode, refused=None)

    elif a.mode == "values":
        ckpt = mpickpt.Checkpointer(root)
        progress = mpickpt.Values(epoch=0, seen=0, best=None)
        alias = progress
        if a.restore:
            start = ckpt.restore({"model": st["model"], "progress": progress})
            record(a.base, a.mode, start=start, epoch=alias.epoch, seen=alias.seen,
                   best=alias.best)
        else:
            progress.epoch, progress.seen, progress.best = 3, 1200 + rank, 0.125
            ckpt.save(5, {"model": st["model"], "progress": progress}).wait()
        ckpt.close()


if __name__ == "__main__":
    main()
