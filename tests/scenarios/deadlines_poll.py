"""A training loop that calls ``should_exit`` every step, with no collective of its own between
steps (each rank trains alone), and a collective deadline of TIMEOUT seconds; rank VICTIM stops
before its should_exit call of step STEP: ACTION ``hang`` sleeps forever, ``kill`` SIGKILLs itself.

Usage: deadlines_poll.py ROOT STEPS TIMEOUT VICTIM ACTION STEP
(TIMEOUT ``env``: no timeout argument, so Checkpointer reads $MPICKPT_TIMEOUT.)

Each rank prints ``rank R pid P`` first and ``rank R: finished`` at the end.

Run by tests/multirank/test_deadlines.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import mpickpt


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    timeout = None if sys.argv[3] == "env" else float(sys.argv[3])
    victim, action, at = int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    comm = MPI.COMM_WORLD
    print(f"rank {comm.rank} pid {os.getpid()}", flush=True)
    torch.manual_seed(comm.rank)
    model = torch.nn.Linear(8, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    comm.Barrier()  # ranks that started (imported torch) at different times meet here first
    ck = mpickpt.Checkpointer(root, **({} if timeout is None else {"timeout": timeout}))
    for step in range(1, steps + 1):
        loss = model(torch.randn(4, 8)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        time.sleep(0.02)
        if comm.rank == victim and step == at:
            print(f"rank {comm.rank}: {action} before should_exit of step {step}", flush=True)
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(3600)
        ck.should_exit(step, state)
    ck.close()
    print(f"rank {comm.rank}: finished", flush=True)


if __name__ == "__main__":
    main()
