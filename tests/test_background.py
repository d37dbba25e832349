"""Which of mpickpt's threads yield the CPU to the training thread (mpickpt/background.py): the
I/O threads do (nice +10); the threads that move data over MPI (the transfer waiter, the partner
stream) do not, since a transfer between two ranks moves only while both ranks' threads run.
And a rank that the launcher bound to one CPU of several is told so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from mpickpt.format.iothreads import pool
from mpickpt.local.exchange import Exchange
from mpickpt.mpi import protocol
from mpickpt.mpi.protocol import Protocol

pytestmark = [pytest.mark.quick,
              pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no thread priorities")]


def nice_of(executor) -> int:
    """The priority the executor's thread runs at."""
    return executor.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()


def test_io_threads_yield_and_the_transfer_threads_keep_the_training_threads_priority():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert nice_of(pool(2, True)) == min(base + 10, 19)  # a save's and a restore's I/O
    assert nice_of(pool(2, False)) == base
    assert nice_of(protocol._waiter()) == base  # waits in Waitall while transfers move
    proto = Protocol()
    exchange = Exchange(proto, [[proto.rank]], "partner", window=4096)
    try:
        assert nice_of(exchange._streamer) == base  # posts the partner copy's windows
    finally:
        exchange.free()
        proto.free()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs to run on")
@pytest.mark.parametrize("bound", [True, False])
def test_a_rank_bound_to_one_cpu_is_warned_at_the_checkpointers_construction(tmp_path, bound):
    """Open MPI's mpirun binds each of two ranks to one core, srun gives a task one CPU: the
    I/O threads then share it with training (measured: a restart 1.7x slower). The warning
    names the CPU and the launchers' options; a rank with several CPUs gets none."""
    pin = "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n" if bound else ""
    code = (f"import os\n{pin}import mpickpt\n"
            f"ck = mpickpt.Checkpointer({str(tmp_path)!r})\nck.close()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    warned = "this rank may run on 1 CPU only" in p.stderr
    if bound:
        assert warned, p.stderr
        assert "its 8 I/O threads" in p.stderr and "--cpus-per-task" in p.stderr, p.stderr
        assert "--bind-to none" in p.stderr, p.stderr
    else:
        assert not warned, p.stderr
