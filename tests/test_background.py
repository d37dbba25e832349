"""Which of mpickpt's threads yield the CPU to the training thread (mpickpt/background.py): the
I/O threads do (nice +10); the threads that move data over MPI (the transfer waiter, the partner
stream) do not, since a transfer between two ranks moves only while both ranks' threads run."""

from __future__ import annotations

import os
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
