"""A timeline of a restore's parts, per rank: every call of the functions in :data:`PARTS` is
recorded (start, end) once :func:`install` has wrapped them. Used by
``probe_restore_timeline.py`` and ``bench_levels.py --timeline``."""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable

PARTS = [("mpickpt.mpi.protocol", q) for q in (
    "Protocol.alltoall", "Protocol.all_ok", "Protocol.max", "Protocol.sum", "Protocol.sums",
    "Protocol.allgather", "Protocol.bcast", "Protocol.start", "Pending.wait")] + [
    ("mpickpt.local.remote", "_serve"), ("mpickpt.local.remote", "start_verify_spans"),
    ("mpickpt.format.state_tree", "apply"),
    ("mpickpt.local.recovery", "LocalRecovery.prepare"), ("mpickpt.restore.reshard", "stage"),
    ("mpickpt.restore.reshard", "plan"), ("mpickpt.restore.reshard", "Staged.read"),
    ("mpickpt.restore.reshard", "Staged.finish"), ("mpickpt.format.reader", "MappedSpans.verify"),
    ("mpickpt.format.reader", "MappedSpans.populate"),
    ("mpickpt.save.pinned_pool", "HostPool.lock"), ("mpickpt.save.pinned_pool", "HostPool.acquire"),
    ("mpickpt.restore.restorer", "Restorer._agree_and_apply"),
    ("mpickpt.restore.restorer", "Restorer._fetch"),
    ("mpickpt.restore.restorer", "Restorer._read_here"),
    ("mpickpt.restore.device_room", "DeviceRoom.buffers"),
    ("mpickpt.restore.device_room", "DeviceRoom.take_ring"),
    ("mpickpt.restore.device_room", "DeviceRoom.close"),
    ("mpickpt.local.xorteam", "xor_land"), ("mpickpt.local.xorteam", "xor_rebuild"),
    ("mpickpt.local.xorlanding", "XorLanding.finish"),
    ("mpickpt.local.filemap", "FileMap.__enter__"), ("mpickpt.local.filemap", "FileMap.__exit__"),
    ("mpickpt.local.filemap", "FileMap.populate")]
# called once per block of an XOR rebuild: summed per rank (calls, total, first start -> last
# end) rather than listed one by one
SUMMED = [("mpickpt.local.xorring", q) for q in (
    "xor_into", "_Flow.send_done", "_Flow.post", "_Flow.composed")] + [
    ("mpickpt.local.xorlanding", q) for q in ("XorLanding.into", "XorLanding._use")] + [
    ("mpickpt.local.parity", "file_parts")]
EVENTS: list[tuple[str, float, float]] = []


def timed(module: str, qualname: str, clock: Callable[[], float],
          record: Callable[[str, float, float], None]) -> None:
    """Wrap ``module.qualname`` so that every call tells ``record(qualname, start, end)``, both
    read from ``clock``, however the call ends."""
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for p in path:
        owner = getattr(owner, p)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            record(qualname, t, clock())

    setattr(owner, name, call)


def wrap(module: str, qualname: str) -> None:
    """Record every call of ``module.qualname`` (start, end) in :data:`EVENTS`."""
    timed(module, qualname, time.perf_counter, lambda q, a, b: EVENTS.append((q, a, b)))


def install() -> None:
    """Wrap every part of :data:`PARTS` that the package has (an older one, timed beside the
    current, may lack some)."""
    for module, qualname in PARTS + SUMMED:
        try:
            wrap(module, qualname)
        except AttributeError:
            continue


def lines(t0: float) -> list[str]:
    """The calls recorded since ``t0``, in ms from it; those of :data:`SUMMED` summed."""
    summed = {q for _, q in SUMMED}
    out = [f"  {q:28s} {1e3 * (s - t0):8.1f} -> {1e3 * (e - t0):8.1f}  ({1e3 * (e - s):7.1f} ms)"
           for q, s, e in EVENTS if s >= t0 and q not in summed]
    for q in sorted(summed):
        calls = [(s, e) for name, s, e in EVENTS if name == q and s >= t0]
        if calls:
            out.append(f"  {q:28s} {1e3 * (calls[0][0] - t0):8.1f} -> "
                       f"{1e3 * (calls[-1][1] - t0):8.1f}  ({len(calls)} calls, "
                       f"{1e3 * sum(e - s for s, e in calls):.1f} ms in all)")
    return out
