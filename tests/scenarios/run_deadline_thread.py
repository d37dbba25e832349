"""The checkpointer's shape when a rank hangs: the last rank never joins a barrier; the others
wait for it on a background thread, under ``Protocol.fatal_timeouts``, while their main thread
waits for that thread's result. The missed deadline must end the job with exit code 75 and
nothing after the abort may run. MPICH's ``MPI_Abort`` can return while the launcher tears the
job down: the thread then went on, the main thread got the ``CollectiveTimeout``, and the run
wrapper printed it and raced the deadline's 75 with its own ``abort(1)``.

Run by tests/test_run.py.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from mpi4py import MPI

from mpickpt.mpi.protocol import Protocol

proto = Protocol(timeout=1.0, grace=1.0)
log = logging.getLogger("run_deadline_thread")
if proto.rank == proto.size - 1:
    time.sleep(60)  # hangs: the others' deadline ends the job long before
    raise SystemExit(0)


def wait_for_everyone() -> None:
    try:
        with proto.fatal_timeouts(log):
            proto.barrier("everyone")
    finally:  # the abort must end the process here: no unwinding, nothing after
        print(f"rank {proto.rank}: the thread went on after the abort", flush=True)


ThreadPoolExecutor(1, thread_name_prefix="saver").submit(wait_for_everyone).result()
print(f"rank {proto.rank}: the main thread went on after the abort", flush=True)
MPI.COMM_WORLD.Barrier()
