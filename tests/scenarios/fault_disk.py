"""Train examples/train.py's model and save at steps 5, 10, 15 and 20, with the save of step 15
made to fail on every rank by the file system under ROOT; the fault is repaired between the saves
of steps 15 and 20. Then restore steps 20, 10 and 5, each into a fresh state.

Usage: fault_disk.py ROOT MODE REPORTS, where MODE is:

  enospc    ROOT's parent is a small tmpfs: rank 0 fills it with a ballast file up to FREE bytes,
            less than one shard, so that every rank runs out of space in the middle of writing;
            the ballast is removed after the failed save
  readonly  ROOT is a tmpfs mount point: rank 0 remounts it read-only (mount -o remount,ro), and
            read-write after the failed save (the job needs CAP_SYS_ADMIN)
  perm      rank 0 takes the write permission off ROOT (chmod 0555), and gives it back after the
            failed save; the job must run without CAP_DAC_OVERRIDE (the scenario checks that it
            really cannot create a file in ROOT)
  ro-restore  ROOT (holding the checkpoints of an earlier run) is read-only from the start: the
            Checkpointer is constructed, restores the newest checkpoint, compared bit for bit with
            a rerun of the same 20 steps, and tries to save step 25
  retention-perm  keep=2, and the save of step 15 commits while retention cannot delete step 5
            (its directory made 0555) and stats.jsonl is 0444; needs no CAP_DAC_OVERRIDE like perm

Each rank writes REPORTS/rank-R.json: every SaveResult, what rank 0 saw under ROOT after the
failed save, the free bytes and shard size at the failed save (enospc), its open file descriptors
after the saves of steps 10 and 20, and each restore's step and whether the state equals the one
saved.

Run by tests/faults/test_fault_disk.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpi4py import MPI

import mpickpt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_report
from fault_restore import Trainer, fill, image, outcome
from train import make_state, train_step

FAILED = 15
WIDTH = 256  # about 0.9 MB per shard (parameters and Adam's two moments)
FREE = 128 << 10


def mount(*opts: str, where: str) -> None:
    subprocess.run(["mount", "-o", ",".join(opts), where], check=True)


def break_root(mode: str, root: str) -> tuple[dict, object]:
    """Rank 0: make every rank's save fail; return facts for the report and the repair."""
    if mode == "enospc":
        ballast = os.path.join(os.path.dirname(root), "ballast")
        free = fill(ballast, FREE)
        return {"free": free}, lambda: os.unlink(ballast)
    if mode == "readonly":
        mount("remount", "ro", where=root)
        return {}, lambda: mount("remount", "rw", where=root)
    if mode == "perm":
        os.chmod(root, 0o555)
        try:
            open(os.path.join(root, "probe"), "w").close()
        except PermissionError:
            return {}, lambda: os.chmod(root, 0o755)
        raise SystemExit("the job can write into a 0555 directory: run it without "
                         "CAP_DAC_OVERRIDE (setpriv --inh-caps=-dac_override ...)")
    raise SystemExit(f"unknown mode {mode!r}")


def restore_read_only(root: str, reports: str) -> None:
    """ROOT is read-only from the start: construct, restore the newest step (20) bit-exact
    against a rerun of the same training, then try to save step 25."""
    comm = MPI.COMM_WORLD
    rank = comm.rank
    expected = make_state(rank, WIDTH)
    for _ in range(20):
        train_step(expected, comm)
    state = make_state(rank, WIDTH)
    ck = mpickpt.Checkpointer(root)
    got = ck.restore(state)
    restored = [got, image(state) == image(expected)]
    train_step(state, comm)
    result = ck.save(25, state).wait()
    ck.close()
    write_report(reports, f"rank-{rank}.json", {"rank": rank, "restored": restored,
                     "save": outcome(result)})


def retention_blocked(root: str, reports: str) -> None:
    """keep=2; before the save of step 15, rank 0 takes the write permission off step 5's
    directory (retention cannot delete it) and off stats.jsonl; both are given back before the
    save of step 20. Then restore steps 20 and 15."""
    comm = MPI.COMM_WORLD
    rank = comm.rank
    state = make_state(rank, WIDTH)
    ck = mpickpt.Checkpointer(root, keep=2)
    train_and_save = Trainer(state, comm, ck)

    train_and_save(5)
    train_and_save(10)
    stats = os.path.join(root, "stats.jsonl")
    if rank == 0:
        os.chmod(os.path.join(root, "step-00000005"), 0o555)
        os.chmod(stats, 0o444)
        try:
            open(stats, "a").close()
            raise SystemExit("the job can write a 0444 file: run it without CAP_DAC_OVERRIDE")
        except PermissionError:
            pass
    comm.Barrier()
    train_and_save(15)
    comm.Barrier()
    after = sorted(os.listdir(root)) if rank == 0 else None
    if rank == 0:
        os.chmod(stats, 0o644)
        for name in os.listdir(root):
            if name.startswith("step-00000005"):
                os.chmod(os.path.join(root, name), 0o755)
    comm.Barrier()
    train_and_save(20)
    restored = []
    for step in (20, 15):
        fresh = make_state(rank, WIDTH)
        restored.append([ck.restore(fresh, step=step),
                         image(fresh) == train_and_save.images[step]])
    ck.close()
    write_report(reports, f"rank-{rank}.json", {
        "rank": rank,
        "saves": train_and_save.saves(),
        "after": after,
        "restored": restored,
    })


def main() -> None:
    root, mode, reports = sys.argv[1:4]
    if mode == "ro-restore":
        return restore_read_only(root, reports)
    if mode == "retention-perm":
        return retention_blocked(root, reports)
    comm = MPI.COMM_WORLD
    rank = comm.rank
    state = make_state(rank, WIDTH)
    ck = mpickpt.Checkpointer(root)
    train_and_save, facts = Trainer(state, comm, ck), {}

    train_and_save(5)
    train_and_save(10)
    fds = [len(os.listdir("/proc/self/fd"))]
    repair = lambda: None  # noqa: E731
    if rank == 0:
        facts, repair = break_root(mode, root)
        facts["shard_bytes"] = os.path.getsize(
            os.path.join(train_and_save.results[10].path, "rank-00000.h5"))
    comm.Barrier()
    train_and_save(FAILED)
    comm.Barrier()  # every rank is past the failed save before the repair
    repair()
    after_abort = sorted(os.listdir(root)) if rank == 0 else None
    comm.Barrier()
    train_and_save(20)
    fds.append(len(os.listdir("/proc/self/fd")))

    restored = []
    for step in (20, 10, 5):
        fresh = make_state(rank, WIDTH)
        got = ck.restore(fresh, step=None if step == 20 else step)
        restored.append([got, image(fresh) == train_and_save.images[step]])
    ck.close()
    write_report(reports, f"rank-{rank}.json", {
        "rank": rank,
        "saves": train_and_save.saves(),
        "after_abort": after_abort,
        "facts": facts,
        "fds": fds,
        "restored": restored,
    })


if __name__ == "__main__":
    main()
