"""Under mpickpt.run: the torch.distributed environment matches MPI, and
``init_process_group("gloo")`` with no other arguments works. Prints one line per rank:
``env RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT sum S``.

Run by tests/test_run.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from mpi4py import MPI

comm = MPI.COMM_WORLD
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
env = [os.environ[n] for n in names]
assert int(env[0]) == comm.rank and int(env[1]) == comm.size, env

dist.init_process_group("gloo")
assert dist.get_rank() == comm.rank and dist.get_world_size() == comm.size
t = torch.tensor([dist.get_rank()], dtype=torch.int64)
dist.all_reduce(t)
want = comm.size * (comm.size - 1) // 2
assert t.item() == want, (t.item(), want)
dist.destroy_process_group()
print(f"env {' '.join(env)} sum {t.item()}", flush=True)  # one write: lines of ranks may interleave
