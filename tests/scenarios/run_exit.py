"""Usage: run_exit.py CODE [RANK]. Every rank (or only RANK, while the others wait for it in a
barrier that it never joins) raises ``SystemExit(CODE)``; CODE ``interrupt`` raises
KeyboardInterrupt instead.

``RUN_EXIT_LINGER=R:SECONDS`` in the environment: rank R is slow to leave, as a rank whose
interpreter takes long to tear down is: after MPI_Finalize it sleeps SECONDS at exit. Every rank
prints ``rank N left`` as its last line.

``RUN_EXIT_LATE_SIGNAL=1``: as it raises, every rank starts a shell that sends it the preemption
signal (SIGUSR2) every half millisecond until the rank is gone, so the signal meets each stage of
its teardown, the interpreter's last ones included (a Slurm ``--signal`` that came late).

Run by tests/test_run.py and tests/slurm/test_slurm_smoke.py.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.rank
linger_rank, _, linger_s = os.environ.get("RUN_EXIT_LINGER", "-1:0").partition(":")


def leave() -> None:
    """Registered after mpickpt.run's own MPI_Finalize handler, so it runs before it."""
    MPI.Finalize()
    if rank == int(linger_rank):
        time.sleep(float(linger_s))
    print(f"rank {rank} left", flush=True)


atexit.register(leave)
code = sys.argv[1]
only = int(sys.argv[2]) if len(sys.argv) > 2 else None
if only is None:
    comm.Barrier()
if only is None or comm.rank == only:
    print(f"rank {comm.rank} exits with {code}", flush=True)
    if os.environ.get("RUN_EXIT_LATE_SIGNAL"):
        subprocess.Popen(["sh", "-c", f"while kill -USR2 {os.getpid()} 2>/dev/null; "
                          "do sleep 0.0005; done"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # the launcher must not wait for its output
    if code == "interrupt":
        raise KeyboardInterrupt
    raise SystemExit(int(code))
comm.Barrier()
