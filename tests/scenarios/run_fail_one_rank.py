"""Rank 2 raises while the other ranks wait for it in an allreduce, which would hang forever.

Run by tests/test_run.py.
"""

from __future__ import annotations

import time

from mpi4py import MPI

comm = MPI.COMM_WORLD


def load_batch() -> None:
    raise RuntimeError("rank 2 cannot read its batch: injected failure")


if comm.rank == 2:
    time.sleep(0.5)  # the others are surely waiting in the allreduce
    load_batch()
comm.allreduce(comm.rank)
print(f"rank {comm.rank} passed the allreduce", flush=True)  # never: rank 2 is not there
