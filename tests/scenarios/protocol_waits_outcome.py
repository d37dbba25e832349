"""A save's outcome on the ranks that only learn it: once it is later than expected they doze
while nobody waits for it, and wait as before once someone does (mpickpt/mpi/polling.py's
Waker). Rank 0's commit is made slower by DELAY (a slow disk's).

Every rank counts its save thread's dozes: those that slept their nap out ("slept") and those cut
short or skipped because someone waited ("woken"). Three parts, on every rank alike:
- waited: commits of 0.1 s, each save waited for at once (``handle.wait()``): no doze sleeps;
- left: a commit of 0.3 s (the last ones took 0.1), the save left alone for 0.6 s: the waits
  doze past their expected 0.1 s, a test each 50 ms, and find the outcome by themselves;
- loop: commits of 0.3 s, saves 0.15 s apart, then ``ck.wait()``: the next save (or the wait)
  wakes the last one's doze; every save commits.

Run by tests/multirank/test_protocol_waits.py with ROOT as argv[1].
"""

from __future__ import annotations

import sys
import time

import torch

import mpickpt
from mpickpt.mpi.polling import Waker
from mpickpt.save import rootstore

counts = {"slept": 0, "woken": 0}
real_doze = Waker.doze


def doze(self: Waker, seconds: float) -> bool:
    woken = real_doze(self, seconds)
    counts["woken" if woken else "slept"] += 1
    return woken


Waker.doze = doze  # type: ignore[method-assign]
DELAY = [0.0]
real_commit = rootstore.RootStore._commit


def slow_commit(self: rootstore.RootStore, *args: object) -> str:
    time.sleep(DELAY[0])
    return real_commit(self, *args)  # type: ignore[arg-type]


rootstore.RootStore._commit = slow_commit  # type: ignore[method-assign]


def part(name: str) -> None:
    print(f"rank {rank}: {name}: slept {counts['slept']} woken {counts['woken']}", flush=True)
    counts.update(slept=0, woken=0)


state = {"w": torch.arange(1000.0)}
with mpickpt.Checkpointer(sys.argv[1], keep=2, replicated=("w",), on_error="raise") as ck:
    rank = ck.rank
    DELAY[0] = 0.1
    for step in range(1, 4):
        assert ck.save(step, state).wait().committed
    part("waited")
    DELAY[0] = 0.3
    h = ck.save(4, state)
    time.sleep(0.6)
    assert h.done() and h.wait().committed
    part("left")
    handles = []
    for step in range(5, 9):
        handles.append(ck.save(step, state))
        time.sleep(0.15)
    ck.wait()
    assert all(h.done() and h.outcome().committed for h in handles)
    part("loop")
