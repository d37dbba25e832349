"""``mpickpt.run.main(train)`` from a script started with plain mpiexec.

Usage: run_main_fn.py [fail]. ``train`` checks the environment and allreduces the ranks; with
``fail``, rank 1 raises inside it while the others wait in the allreduce.

Run by tests/test_run.py.
"""

from __future__ import annotations

import os
import sys

from mpi4py import MPI

import mpickpt.run


def train() -> None:
    comm = MPI.COMM_WORLD
    assert os.environ["RANK"] == str(comm.rank)
    assert os.environ["WORLD_SIZE"] == str(comm.size)
    if sys.argv[1:] == ["fail"] and comm.rank == 1:
        raise ValueError("rank 1 fails inside main(fn)")
    total = comm.allreduce(comm.rank)
    print(f"rank {comm.rank} sum {total}", flush=True)


if __name__ == "__main__":
    mpickpt.run.main(train)
