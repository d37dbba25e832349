"""Train examples/train.py's model for STEPS steps with a save every 5 and a collective deadline of
TIMEOUT seconds; meant to run with MPICKPT_FAULT making one rank hang in a save.

Usage: save_hang.py ROOT STEPS TIMEOUT

Run by tests/faults/test_fault_kill.py and tests/multirank/test_deadlines.py, which both
make one rank hang in a save and expect the collective deadline to end the job: hence a
name for what they share rather than for one of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

import mpickpt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import make_state, train_step


def main() -> None:
    root, steps, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    comm = MPI.COMM_WORLD
    state = make_state(comm.rank, 64)
    comm.Barrier()  # ranks that started (imported torch) at different times meet here first
    ck = mpickpt.Checkpointer(root, timeout=timeout)
    for step in range(steps):
        train_step(state, comm)
        if (step + 1) % 5 == 0:
            ck.save(step + 1, state).wait()
    ck.close()
    print(f"rank {comm.rank}: finished", flush=True)


if __name__ == "__main__":
    main()
