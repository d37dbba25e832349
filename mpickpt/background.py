"""Threads that work behind the training loop (writes, reads) yield the CPU to it.

The threads that move data over MPI (the partner stream and the transfer waiter) do not: a
transfer between two ranks progresses only while both ranks' threads run, so a lower priority
starves it twice over. Measured on one H200 host (16 cores, two ranks as two nodes training,
2 GB of state, ``bench/probe_protect_training.py``): protected 14.6 s after save() with those
two threads at nice +10, against 2.4 s at the training thread's priority, with the training
steps meanwhile at 0.998x and 1.047x of their time without a save.
"""

from __future__ import annotations

import os
import threading


def lower_priority() -> None:
    """Give the calling thread a lower CPU priority than the training thread (nice +10): the
    I/O threads' initializer."""
    if hasattr(os, "setpriority"):  # elsewhere the threads keep the process priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
