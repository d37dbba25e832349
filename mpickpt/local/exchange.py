"""Redundancy for the node-local level, over MPI: partner copies and XOR parity.

The protocol layer's data plane (:mod:`mpickpt.mpi.protocol` holds every MPI call): files stream
through two buffers of ``window`` bytes that are allocated once and reused by every checkpoint,
each transfer within the protocol's deadline. The layout rules (who protects whom, how XOR cuts
a shard into chunks) are :mod:`mpickpt.local.topology`'s.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..format import rootdir
from ..mpi.protocol import Pending, Protocol
from .topology import partner_holder, partner_source, team_of, xor_chunk, xor_chunk_bytes

WINDOW = 32 << 20
DEPTH = 4  # partner windows in flight


class _Mapped:
    """A file as a shared memory map (``create``: made, its blocks allocated first, so that a
    full disk is an error here rather than a SIGBUS later; fsynced when it closes)."""

    def __init__(self, path: str, size: int, create: bool = False) -> None:
        self.path, self.size, self.create = path, size, create
        self.error: OSError | None = None
        self._map: mmap.mmap | None = None
        self._arr: np.ndarray | None = None

    def __enter__(self) -> _Mapped:
        if self.create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                         rootdir.file_mode(self.path))
        else:
            fd = rootdir.open_regular(self.path)
        self.fd = fd
        try:
            if self.size:
                if self.create:
                    os.posix_fallocate(fd, 0, self.size)
                self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | (
                    mmap.PROT_WRITE if self.create else 0))
                self._arr = np.frombuffer(self._map, dtype=np.uint8)
        except OSError as e:
            if not self.create:
                os.close(fd)
                raise
            self.error = OSError(e.errno, e.strerror, self.path)
        return self

    def view(self, off: int, n: int) -> np.ndarray:
        assert self._arr is not None
        return self._arr[off:off + n]

    def put(self, off: int, data: memoryview) -> None:
        """Copy ``data`` into the file at ``off`` (torch's copy lets go of the GIL)."""
        assert self._arr is not None
        torch.from_numpy(self._arr[off:off + len(data)]).copy_(
            torch.frombuffer(data, dtype=torch.uint8))

    def __exit__(self, *exc: object) -> None:
        self._arr = None
        if self._map is not None:
            # MPI may still hold a view of it: then the map goes with its last reference
            with contextlib.suppress(BufferError):
                self._map.close()
        try:
            if self.create:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _pread(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        buf, offset = buf[n:], offset + n


def _pwrite(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _create(path: str, size: int | None = None) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                 rootdir.file_mode(path))
    if size:
        os.ftruncate(fd, size)
    return fd


def _seal(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Keep:
    """The first error of the local side of an exchange; the transfers go on regardless, so
    that a peer never waits for a window this rank would not send."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def do(self, fn: Callable[..., object], *args: object) -> None:
        if self.error is None:
            try:
                fn(*args)
            except Exception as e:
                self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass
class Moved:
    """What one rank sent and received over the network."""

    sent: int = 0
    received: int = 0


class Exchange:
    """One rank's side of the redundancy of its team (``scheme`` "partner" or "xor")."""

    def __init__(self, proto: Protocol, teams: list[list[int]], scheme: str,
                 window: int | None = None) -> None:
        self.proto, self.teams, self.scheme = proto, teams, scheme
        self.window = window or WINDOW
        self.rank = proto.rank
        self.team = team_of(teams, self.rank)
        self.pos = self.team.index(self.rank)
        self.team_proto = proto.sub(teams.index(self.team), self.pos) if scheme == "xor" else None
        self._bufs: dict[str, np.ndarray] = {}
        # allocated (and touched) once, here: the first save does not pay for them
        wide = len(self.team) if scheme == "xor" else 1
        for name in ("out0", "out1"):
            np.asarray(self.buffer(name, wide * self.window))[:] = 0
        for slot in range(DEPTH):
            np.asarray(self.buffer(f"in{slot}", self.window))[:] = 0
        self._copier = ThreadPoolExecutor(DEPTH, thread_name_prefix="mpickpt-copy")

    def buffer(self, name: str, nbytes: int) -> memoryview:
        """A reused byte buffer of at least ``nbytes``."""
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[name] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return memoryview(buf)[:nbytes]

    def free(self) -> None:
        self._copier.shutdown()
        self._bufs.clear()
        if self.team_proto is not None:
            self.team_proto.free()

    # ---------------------------------------------------------------------------------- saving

    def protect(self, directory: str, own: str, size: int, names: Callable[[int], str],
                on_window: Callable[[], None] = lambda: None) -> Moved:
        """Protect this rank's shard ``own`` (``size`` bytes): ``partner``: send it to its holder
        and store the copy of the rank this one holds as ``directory/names(source)``; ``xor``:
        store this rank's parity as ``directory/names(rank)``. Collective over the team."""
        if self.scheme == "partner":
            return self._partner(directory, own, size, names, on_window)
        return self._xor(directory, own, size, names, on_window)

    def _partner(self, directory: str, own: str, size: int, names: Callable[[int], str],
                 on_window: Callable[[], None]) -> Moved:
        """The shard goes out of a memory map of its file, ``DEPTH - 1`` windows in flight; the
        copy comes into reused buffers, and threads copy each into a memory map of the copy's
        file (in parallel: a single writer of fresh pages is the slowest part)."""
        holder, source = partner_holder(self.teams, self.rank), partner_source(self.teams,
                                                                               self.rank)
        mine, theirs = np.array([size], dtype=np.int64), np.zeros(1, dtype=np.int64)
        self.proto.transfer([(mine, holder)], [(theirs, source)], "the partner exchange")
        other = int(theirs[0])
        keep = _Keep()
        copies: list[Future[None] | None] = [None] * DEPTH
        with _Mapped(own, size) as out, _Mapped(os.path.join(directory, names(source)), other,
                                                 create=True) as into:
            keep.error = into.error  # no room for the copy: receive all the same, then fail
            flying: deque[tuple[Pending, int, int, int]] = deque()

            def land() -> None:
                pending, slot, off, n = flying.popleft()
                pending.wait()
                if n and into.error is None:
                    copies[slot] = self._copier.submit(into.put, off,
                                                       self.buffer(f"in{slot}", n))
                keep.do(on_window)

            for k, off in enumerate(range(0, max(size, other), self.window)):
                n_out, n_in = _span(size, off, self.window), _span(other, off, self.window)
                if len(flying) >= DEPTH - 1:
                    land()
                slot = k % DEPTH
                done = copies[slot]
                if done is not None:  # its last window is in the file: the buffer is free
                    keep.do(done.result)
                    copies[slot] = None
                flying.append((self.proto.start(
                    [(out.view(off, n_out), holder)] if n_out else [],
                    [(self.buffer(f"in{slot}", n_in), source)] if n_in else [],
                    "the partner exchange"), slot, off, n_in))
            while flying:
                land()
            for done in copies:
                if done is not None:
                    keep.do(done.result)
        keep.check()
        return Moved(size, other)

    @staticmethod
    def _land(sent: tuple[Pending, memoryview, int], dst: int, keep: _Keep,
              on_window: Callable[[], None]) -> None:
        """Wait for a window's transfer; write what came in."""
        pending, into, off = sent
        pending.wait()
        keep.do(_pwrite, dst, into, off)
        keep.do(on_window)

    def _xor(self, directory: str, own: str, size: int, names: Callable[[int], str],
             on_window: Callable[[], None]) -> Moved:
        assert self.team_proto is not None
        n = len(self.team)
        chunk = xor_chunk_bytes(self.team_proto.max(size, "the XOR parity"), n)
        src = rootdir.open_regular(own)
        dst = _create(os.path.join(directory, names(self.rank)), chunk)
        keep = _Keep()
        prev: tuple[Pending, memoryview, int] | None = None
        try:
            for k, off in enumerate(range(0, chunk, self.window)):
                w = min(self.window, chunk - off)
                out = np.frombuffer(self.buffer(f"out{k % 2}", n * w),
                                    dtype=np.uint8).reshape(n, w)
                for j in range(n):
                    if j == self.pos:
                        out[j] = 0
                    else:
                        _read_padded(src, size, xor_chunk(n, self.pos, j) * chunk + off, out[j])
                into = self.buffer(f"in{k % 2}", w)
                cur = (self.team_proto.xor_scatter(out, np.frombuffer(into, dtype=np.uint8),
                                                   "the XOR parity"), into, off)
                if prev is not None:
                    self._land(prev, dst, keep, on_window)
                prev = cur
            if prev is not None:
                self._land(prev, dst, keep, on_window)
        finally:
            os.close(src)
            _seal(dst)
        keep.check()
        return Moved((n - 1) * chunk, chunk)


def _span(size: int, off: int, window: int) -> int:
    return max(0, min(window, size - off))


def _read_padded(fd: int, size: int, start: int, out: np.ndarray) -> None:
    """File bytes ``[start, start + len(out))``, zeros past ``size``."""
    have = max(0, min(len(out), size - start))
    if have:
        _pread(fd, memoryview(out[:have]), start)
    out[have:] = 0


# ------------------------------------------------------------------------------------ rebuilding


def copy_over(proto: Protocol, moves: list[tuple[int, int, str, int]], window: int,
              buffer: Callable[[str, int], memoryview], copier: ThreadPoolExecutor) -> int:
    """Each ``(donor, receiver, path, size)`` in order: the donor sends its file ``path`` out of
    a memory map, the receiver writes it to its own ``path`` (the receiver's) through one, as
    the partner exchange does. Bytes received."""
    got = 0
    for donor, receiver, path, size in moves:
        if proto.rank in (donor, receiver):
            _copy_one(proto, donor, receiver, path, size, window, buffer, copier)
            got += size if proto.rank == receiver else 0
    return got


def _copy_one(proto: Protocol, donor: int, receiver: int, path: str, size: int, window: int,
              buffer: Callable[[str, int], memoryview], copier: ThreadPoolExecutor) -> None:
    sending = proto.rank == donor
    copies: list[Future[None] | None] = [None] * DEPTH
    with _Mapped(path, size, create=not sending) as f:
        if f.error is not None:
            raise f.error
        flying: deque[tuple[Pending, int, int, int]] = deque()

        def land() -> None:
            pending, slot, off, n = flying.popleft()
            pending.wait()
            if not sending and n:
                copies[slot] = copier.submit(f.put, off, buffer(f"in{slot}", n))

        for k, off in enumerate(range(0, size, window)):
            n = _span(size, off, window)
            if len(flying) >= DEPTH - 1:
                land()
            slot = k % DEPTH
            done = copies[slot]
            if done is not None:
                done.result()
                copies[slot] = None
            flying.append((proto.start([(f.view(off, n), receiver)] if sending else [],
                                       [] if sending else [(buffer(f"in{slot}", n), donor)],
                                       "the rebuild from a partner copy"), slot, off, n))
        while flying:
            land()
        for done in copies:
            if done is not None:
                done.result()


def xor_rebuild(team: Protocol, lost: int, chunk: int, sizes: list[int], own: str | None,
                parity: str | None, out_shard: str | None, out_parity: str | None,
                window: int, buffer: Callable[[str, int], memoryview]) -> int:
    """Rebuild the shard and the parity of team position ``lost`` on that member, from the
    others' shards (``own``) and parities; collective over ``team``. Bytes received."""
    n, me = team.size, team.rank
    src = rootdir.open_regular(own) if me != lost and own else -1
    par = rootdir.open_regular(parity) if me != lost and parity else -1
    out = _create(out_shard, sizes[lost]) if me == lost and out_shard else -1
    outp = _create(out_parity, chunk) if me == lost and out_parity else -1
    try:
        for off in range(0, chunk, window):
            w = min(window, chunk - off)
            send = np.frombuffer(buffer("out", n * w), dtype=np.uint8).reshape(n, w)
            if me == lost:
                send[:] = 0
            else:
                for k in range(n):
                    if k == me:
                        _pread(par, memoryview(send[k]), off)
                    else:
                        _read_padded(src, sizes[me], xor_chunk(n, me, k) * chunk + off, send[k])
            recv = (np.frombuffer(buffer("in", n * w), dtype=np.uint8).reshape(n, w)
                    if me == lost else None)
            team.xor_reduce(send, recv, lost, "the XOR rebuild")
            if recv is not None:
                for k in range(n):
                    if k == lost:
                        _pwrite(outp, memoryview(recv[k]), off)
                        continue
                    start = xor_chunk(n, lost, k) * chunk + off
                    have = max(0, min(w, sizes[lost] - start))
                    if have:
                        _pwrite(out, memoryview(recv[k][:have]), start)
        return sizes[lost] + chunk if me == lost else 0
    finally:
        for fd in (src, par):
            if fd >= 0:
                os.close(fd)
        for fd in (out, outp):
            if fd >= 0:
                _seal(fd)
