"""A partner stream sent while its bytes are still landing (``Exchange.stream`` with a
:class:`~mpickpt.save.landing.Landing`), as a GPU state's save sends it: two ranks, each the
other's partner, each with a host buffer of garbage that a thread fills with the real bytes a
MiB at a time. Each rank's copy of the other must hold the real bytes, never the garbage sent
too early. Then again with a landing that fails halfway on rank 0: that side reports the failure,
its windows still go, and neither rank waits past its deadline.

With a second argument, the deadlines of such a stream (3 s here), each must end it with a
CollectiveTimeout naming the phase and never hang: ``hang``, rank 1 never joins the stream (a
peer that hangs before it): rank 0 gives up at the deadline; ``stuck``, rank 0's bytes never
land (for rank 1, a peer that stops in the middle of the stream): rank 0 gives up posting its
sends, and rank 1, whose receives are posted and never fill, gives up waiting; ``stuck-full``,
the same with no room for rank 0's copy of rank 1: rank 0's save fails, so its windows go at
once without waiting to land, and neither rank waits for a deadline. Each rank then
leaves a few seconds later (a job the deadline ends aborts).

Run by tests/multirank/test_transfers.py with a directory to write into.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

import numpy as np
import torch

from mpickpt.errors import CollectiveTimeout
from mpickpt.local.exchange import Exchange
from mpickpt.local.pool import Mapped, Maps
from mpickpt.mpi.protocol import Protocol
from mpickpt.save.landing import Landing


def say(line: str) -> None:
    """``line`` and its newline in one write: two ranks' lines, through mpiexec, do not run
    into each other (``print`` writes the newline apart, and the test parses the lines)."""
    os.write(1, (line + "\n").encode())

MIB = 1 << 20
out_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else None
proto = Protocol(timeout=3 if mode else 60)
me, peer = proto.rank, 1 - proto.rank
ex = Exchange(proto, [[0, 1]], "partner", window=MIB)
maps = Maps()
pool = os.path.join(out_dir, f"pool-{me}")
os.makedirs(pool, exist_ok=True)


def real_bytes(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (9 * MIB + 123,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(rank + 1))


def round_trip(name: str, fail_at: int | None) -> None:
    real = real_bytes(me)
    host = torch.full_like(real, 0xEE)
    landing = Landing(host.data_ptr(), [(0, host.numel())])
    # two tensors in the host buffer's order; in the file, the second first (at 4096)
    a, b = host[: 5 * MIB], host[5 * MIB :]
    ranges = [(4096 + b.numel() + 4096, memoryview(a.numpy())), (4096, memoryview(b.numpy()))]
    data_end = 4096 + b.numel() + 4096 + a.numel()

    def land() -> None:
        for lo in range(0, host.numel(), MIB):
            if fail_at is not None and lo >= fail_at:
                landing.finish(RuntimeError("the copy engine stopped"))
                return
            time.sleep(0.02)
            host[lo : lo + MIB].copy_(real[lo : lo + MIB])
            landing.mark(0, lo, min(lo + MIB, host.numel()))
        landing.finish()

    directory = os.path.join(out_dir, f"{name}-{me}")
    os.makedirs(directory, exist_ok=True)
    lander = threading.Thread(target=land)
    lander.start()
    t0 = time.monotonic()
    streamed = ex.stream(ranges, data_end, lambda src: maps.take(pool, directory, f"copy-{src}"),
                         lambda: None, landing).result(60)
    lander.join()
    took = time.monotonic() - t0
    if fail_at is not None and me == 0:
        assert streamed.error is not None and "copy engine stopped" in str(streamed.error), (
            streamed.error)
        say(f"rank {me}: {name}: the failed landing reported after {took:.2f} s")
        return
    assert streamed.error is None, streamed.error
    assert streamed.received == real.numel(), streamed.received
    assert streamed.dest is not None
    want = real_bytes(peer)
    got = np.fromfile(os.path.join(directory, f"copy-{peer}"), dtype=np.uint8)
    ga = got[4096 + (want.numel() - 5 * MIB) + 4096 :][: 5 * MIB]
    gb = got[4096 : 4096 + want.numel() - 5 * MIB]
    if name == "failed":  # rank 1 holds rank 0's copy of a failed save: not checked
        say(f"rank {me}: {name}: received all {streamed.received} bytes")
        return
    assert (ga == want[: 5 * MIB].numpy()).all() and (gb == want[5 * MIB :].numpy()).all(), (
        f"rank {me}: the copy of rank {peer} holds bytes sent before they landed")
    say(f"rank {me}: {name}: the copy holds the landed bytes")




def deadline(mode: str) -> None:
    """One of the deadline cases (the docstring's); leaves the process."""
    if mode == "hang" and me == 1:
        time.sleep(10)  # never streams; the test's timeout is far off
        os._exit(0)
    host = torch.arange(4 * MIB, dtype=torch.int32).view(torch.uint8)[: 4 * MIB]
    landing = Landing(host.data_ptr(), [(0, host.numel())])
    if not (mode.startswith("stuck") and me == 0):
        landing.finish()  # everything is there
    directory = os.path.join(out_dir, f"{mode}-{me}")
    os.makedirs(directory, exist_ok=True)

    def take(src: int) -> Mapped:
        if mode == "stuck-full" and me == 0:
            raise OSError(errno.ENOSPC, "No space left on device", directory)
        return maps.take(pool, directory, f"copy-{src}")

    t0 = time.monotonic()
    try:
        streamed = ex.stream([(4096, memoryview(host.numpy()))], 4096 + host.numel(), take,
                             lambda: None, landing).result(60)
        say(f"rank {me}: {mode}: the stream ended without a deadline after "
            f"{time.monotonic() - t0:.1f} s, error: {streamed.error}")
    except CollectiveTimeout as e:
        say(f"rank {me}: {mode}: CollectiveTimeout after {time.monotonic() - t0:.1f} s: {e}")
    time.sleep(5)  # the other rank's deadline passes too: a rank that leaves ends the job
    os._exit(0)


if mode:
    deadline(mode)
round_trip("landed", None)
round_trip("failed", 4 * MIB if me == 0 else None)
ex.free()
maps.close()
