"""examples/train.py's job, slowed down and observable, for the Slurm tests (tests/slurm/).

Usage: slurm_jobs.py ROOT OUT STEPS [--sleep S] [--every N] [--keep K]
                     [--local DIR] [--redundancy partner|xor|none] [--persist-every K]

Each rank trains exactly like examples/train.py (width 64), so a run that was preempted, requeued
and resumed ends bit-identical to an uninterrupted ``examples/train.py --no-checkpoint`` run. It
sleeps S seconds per step so that Slurm's signals (30 s granularity) land mid-training, saves a
checkpoint every N steps and calls ``should_exit`` every step (SystemExit(3) on every rank after
the emergency save). ``--local`` (default: $MPICKPT_LOCAL, which slurm/train.sbatch exports),
``--redundancy`` and ``--persist-every`` (0: None) go to the Checkpointer as examples/train.py
passes them. It reports through files in OUT, which every run of a requeued job shares:

* ``progress-R``: one line per finished step, ``STEP JOB RESTART`` (JOB: $SLURM_JOB_ID; RESTART:
  $SLURM_RESTART_COUNT, 0 on a job's first run);
* ``starts-R``: one line per run, ``JOB RESTART START`` (START: the step it resumed from, 0 if
  it started fresh);
* at the end, ``rank-R.pt`` (final parameters and optimizer state) and ``rank-R.json``, as
  ``examples/train.py --out`` writes them.

Run by tests/slurm/test_slurm_jobs.py and tests/slurm/test_slurm_levels.py; docs/slurm.md shows
its command lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import make_state, train_step

import mpickpt

ap = argparse.ArgumentParser()
ap.add_argument("root")
ap.add_argument("out", type=Path)
ap.add_argument("steps", type=int)
ap.add_argument("--sleep", type=float, default=0.5)
ap.add_argument("--every", type=int, default=10)
ap.add_argument("--keep", type=int, default=2)
ap.add_argument("--local", default=os.environ.get("MPICKPT_LOCAL") or None)
ap.add_argument("--redundancy", choices=["partner", "xor", "none"], default="none")
ap.add_argument("--persist-every", type=int, default=10)
args = ap.parse_args()

comm = MPI.COMM_WORLD
job = os.environ.get("SLURM_JOB_ID", "-")
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
args.out.mkdir(parents=True, exist_ok=True)
state = make_state(comm.rank, 64)
local = mpickpt.Local(args.local, persist_every=args.persist_every or None,
                      redundancy=None if args.redundancy == "none" else args.redundancy
                      ) if args.local else None
ck = mpickpt.Checkpointer(args.root, keep=args.keep, local=local)
start = ck.restore(state) or 0
with open(args.out / f"starts-{comm.rank}", "a") as f:
    f.write(f"{job} {restart} {start}\n")
for step in range(start, args.steps):
    train_step(state, comm)
    done = step + 1
    if done % args.every == 0:
        ck.save(done, state)
    with open(args.out / f"progress-{comm.rank}", "a") as f:
        f.write(f"{done} {job} {restart}\n")
    time.sleep(args.sleep)
    ck.should_exit(done, state)
ck.close()
import torch  # noqa: E402

final = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
torch.save(final, args.out / f"rank-{comm.rank}.pt")
report = {"start": start, "job": job, "restart": restart}
(args.out / f"rank-{comm.rank}.json").write_text(json.dumps(report))
