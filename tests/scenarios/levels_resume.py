"""A job of 4 ranks on two simulated nodes (n0: ranks 0-1, n1: ranks 2-3) with a node-local
level and partner copies. ``save``: steps 1-3, then every rank SIGKILLs itself once step 3 is
protected. ``resume`` (after n1's directory was wiped: a lost node): restore, which rebuilds n1's
shards from the partner copies and writes them back behind it, then save step 4 at once: the
first save's collectives (the ROOT and room checks) met the write-back's on the save thread, on
one communicator (a hang, or MPI's failed assertion). Each rank writes what it saw to
OUT/rank-R.json.

    mpiexec -n 4 python levels_resume.py save|resume ROOT LOCAL OUT

Run by tests/multirank/test_levels.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
os.environ["MPICKPT_NODE"] = f"n{rank // 2}"

import torch  # noqa: E402

import mpickpt  # noqa: E402

mode, root, local, out = sys.argv[1:5]
ck = mpickpt.Checkpointer(root, local=mpickpt.Local(local, redundancy="partner",
                                                     persist_every=1000))


def fill(step: int) -> torch.Tensor:
    return torch.full((50_000,), float(rank * 100_000 + step))


state = {"w": fill(0)}
if mode == "save":
    for step in (1, 2, 3):
        state["w"] = fill(step)
        assert ck.save(step, state).wait().committed
    os.kill(os.getpid(), signal.SIGKILL)
start = ck.restore(state)
restored = bool(torch.equal(state["w"], fill(3)))
state["w"] = fill(4)
saved = ck.save(4, state).wait().committed
ck.close()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"start": start, "restored": restored, "level": ck.restore_info.level,
               "saved": saved}, f)
