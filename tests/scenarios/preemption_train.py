"""examples/train.py's job, slowed down and observable, for preemption tests.

Usage: preemption_train.py ROOT OUT STEPS. Each rank writes OUT/pid-R (its pid) and appends the
step it finished to OUT/progress-R, sleeps 50 ms per step so a signal can land mid-training, calls
``should_exit`` every step, and at the end (or never, when preempted) writes its final state the
way examples/train.py --out does.

Run by tests/multirank/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import make_state, train_step

import mpickpt

root, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
out.mkdir(parents=True, exist_ok=True)
(out / f"pid-{comm.rank}").write_text(str(os.getpid()))
state = make_state(comm.rank, 64)
ck = mpickpt.Checkpointer(root, keep=2)
start = ck.restore(state) or 0
for step in range(start, steps):
    train_step(state, comm)
    done = step + 1
    if done % 10 == 0:
        ck.save(done, state)
    with open(out / f"progress-{comm.rank}", "a") as f:
        f.write(f"{done}\n")
    time.sleep(0.05)
    ck.should_exit(done, state)  # raises SystemExit(3) on every rank after the emergency save
ck.close()
import torch  # noqa: E402

final = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
torch.save(final, out / f"rank-{comm.rank}.pt")
(out / f"rank-{comm.rank}.json").write_text(json.dumps({"start": start}))
