"""Threads that work behind the training loop (writes, reads) yield the CPU to it.

The threads that move data over MPI (the partner stream and the transfer waiter) do not: a
transfer between two ranks progresses only while both ranks' threads run, so a lower priority
starves it twice over. Measured on one H200 host (16 cores, two ranks as two nodes training,
2 GB of state, ``bench/probe_protect_training.py``): protected 14.6 s after save() with those
two threads at nice +10, against 2.4 s at the training thread's priority, with the training
steps meanwhile at 0.998x and 1.047x of their time without a save. (Measured under Open MPI's
``mpirun -n 2``, which bound each rank to one core: there priority decides everything; how
much it matters to a rank with cores to spare was not measured.)
"""

from __future__ import annotations

import logging
import os
import threading


def lower_priority() -> None:
    """Give the calling thread a lower CPU priority than the training thread (nice +10): the
    I/O threads' initializer."""
    if hasattr(os, "setpriority"):  # elsewhere the threads keep the process priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity; the machine's count where the
    platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def one_cpu_warning(io_threads: int) -> str | None:
    """Why this rank will checkpoint slowly, where the launcher bound it to one CPU of several
    while it has I/O threads to run (Open MPI's ``mpirun`` binds each rank to one core when it
    starts two or fewer; ``srun`` gives a task one CPU unless ``--cpus-per-task`` says more);
    None otherwise. Measured on a 16-core H100 host, two ranks as two nodes, 5.84 GB of state
    (``probe_restore_timeline.py``): a restart from the node-local level's own shards took
    1.05-1.10 s with each rank bound to a core, 0.61-0.65 s unbound; a lost node 2.17 s, 1.79 s."""
    machine = os.cpu_count() or 1
    if not hasattr(os, "sched_getaffinity") or machine <= 1 or io_threads <= 1:
        return None
    cpus = os.sched_getaffinity(0)
    if len(cpus) > 1:
        return None
    cpu = min(cpus)
    return (f"this rank may run on 1 CPU only (CPU {cpu} of {machine}: its CPU affinity, as "
            f"the launcher set it), which training and its {io_threads} I/O threads share: saves, "
            "restores and the node-local level's transfers run at one core's speed. Give each "
            "rank several CPUs: srun --cpus-per-task=N; Open MPI's mpirun --bind-to none or "
            "--map-by slot:PE=N")


def warn_one_cpu(log: logging.Logger, io_threads: int, rank: int) -> None:
    """On rank 0: log :func:`one_cpu_warning`'s reason, if there is one (rank 0's affinity
    stands for the others': launchers bind every rank alike)."""
    if rank == 0 and (why := one_cpu_warning(io_threads)):
        log.warning("%s (the other ranks were likely bound alike)", why)
