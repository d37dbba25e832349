"""Threads that work behind the training loop (writes, reads, transfers) yield the CPU to it."""

from __future__ import annotations

import os
import threading


def lower_priority() -> None:
    """Give the calling thread a lower CPU priority than the training thread (nice +10): a
    thread initializer for the I/O threads, the partner stream and the transfer waiter."""
    if hasattr(os, "setpriority"):  # elsewhere the threads keep the process priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
