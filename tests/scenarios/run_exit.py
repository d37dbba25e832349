"""Usage: run_exit.py CODE [RANK]. Every rank (or only RANK, while the others wait for it in a
barrier that it never joins) raises ``SystemExit(CODE)``; CODE ``interrupt`` raises
KeyboardInterrupt instead.

Run by tests/test_run.py.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
code = sys.argv[1]
only = int(sys.argv[2]) if len(sys.argv) > 2 else None
if only is None:
    comm.Barrier()
if only is None or comm.rank == only:
    print(f"rank {comm.rank} exits with {code}", flush=True)
    if code == "interrupt":
        raise KeyboardInterrupt
    raise SystemExit(int(code))
comm.Barrier()
