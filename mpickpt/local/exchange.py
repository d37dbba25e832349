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
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format import rootdir
from ..format.blocks import pwrite_all
from ..format.h5image import place
from ..mpi.protocol import Pending, Protocol
from ..save.landing import Landing
from .pool import Mapped
from .topology import partner_holder, partner_source, team_of, xor_chunk, xor_chunk_bytes

WINDOW = 32 << 20
DEPTH = 4  # partner windows in flight
READY_WAIT_S = 0.05  # a window not landed yet: the deadline is looked at this often meanwhile


class _Mapped:
    """A file as a shared memory map (``create``: made, its blocks allocated first, so that a
    full disk is an error here rather than a SIGBUS later; fsynced when it closes)."""

    def __init__(self, path: str, size: int, create: bool = False) -> None:
        self.path, self.size, self.create = path, size, create
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
            os.close(fd)
            raise OSError(e.errno, e.strerror, self.path) from e
        return self

    def view(self, off: int, n: int) -> np.ndarray:
        assert self._arr is not None
        return self._arr[off:off + n]

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


@dataclass
class Streamed:
    """A partner stream's outcome: the copy's file (None if it could not be made), the first
    error of the receiving side, the tensor bytes sent and received."""

    dest: Mapped | None
    error: BaseException | None
    sent: int
    received: int
    seconds: float = 0.0  # from the start of the stream to its end, the partner's wait included


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
        # at the training thread's priority, like the transfer waiter (background.py says why)
        self._streamer = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-stream")

    def buffer(self, name: str, nbytes: int) -> memoryview:
        """A reused byte buffer of at least ``nbytes``."""
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[name] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return memoryview(buf)[:nbytes]

    def free(self) -> None:
        self._streamer.shutdown()
        self._bufs.clear()
        if self.team_proto is not None:
            self.team_proto.free()

    # ---------------------------------------------------------------------------------- saving

    def protect(self, own: str, size: int, names: Callable[[int], str],
                take: Callable[[str], Mapped], on_window: Callable[[], None] = lambda: None
                ) -> Moved:
        """XOR: store this rank's parity of its shard ``own`` (``size`` bytes) in the file
        ``take(names(rank))`` gives (recycled, mapped). Collective over the team. (Partner
        copies stream while the shard is written: :meth:`stream` and :meth:`seal`.)"""
        assert self.scheme == "xor"
        return self._xor(own, size, names, on_window, take)

    # ------------------------------------------------------------- partner copies, streamed

    def stream(self, ranges: list[tuple[int, memoryview]], data_end: int,
               take: Callable[[int], Mapped], on_window: Callable[[], None],
               landing: Landing | None = None) -> Future[Streamed]:
        """Start sending this rank's tensor bytes (``ranges``: each one's offset in its shard
        file and its bytes, straight from the snapshot) to its holder, and receiving the rank
        it holds into ``take(source)`` (its copy's file, recycled and mapped) at the same
        offsets; on the exchange's own thread, while this rank writes its shard. With a
        ``landing`` each window goes once its bytes have landed in host memory (``ranges`` in
        the order they land). A rank that could not lay its shard out streams no ranges, so
        that its partner does not wait."""
        return self._streamer.submit(self._stream, ranges, data_end, take, on_window, landing)

    def _stream(self, ranges: list[tuple[int, memoryview]], data_end: int,
                take: Callable[[int], Mapped], on_window: Callable[[], None],
                landing: Landing | None) -> Streamed:
        t0 = time.perf_counter()
        holder = partner_holder(self.teams, self.rank)
        source = partner_source(self.teams, self.rank)
        phase = "the partner exchange"
        mine = np.array([data_end, len(ranges)], dtype=np.int64)
        theirs = np.zeros(2, dtype=np.int64)
        self.proto.transfer([(mine, holder)], [(theirs, source)], phase)
        their_end, their_n = int(theirs[0]), int(theirs[1])
        spans = np.array([[off, len(v)] for off, v in ranges], dtype=np.int64).reshape(-1, 2)
        their = np.zeros((their_n, 2), dtype=np.int64)
        self.proto.transfer([(spans, holder)] if len(ranges) else [],
                            [(their, source)] if their_n else [], phase)
        keep, dest = _Keep(), None
        try:
            dest = take(source)
            dest.reserve(their_end)
        except Exception as e:  # no room for the copy: receive all the same, then fail
            keep.error = e
        out = [v[lo:lo + self.window] for _, v in ranges for lo in range(0, len(v), self.window)]
        into = [(int(off) + lo, min(self.window, int(n) - lo)) for off, n in their
                for lo in range(0, int(n), self.window)]
        if keep.error is None and dest is not None:
            # every window posted at once, straight into the copy's pages: MPI keeps the link
            # busy, and no window waits for a thread posting the next one; while the bytes land
            # (a GPU state), each send goes once its window has
            sends = [(v, holder) for v in out]
            recvs = [(dest.view(off, n), source) for off, n in into]
            pending = (self.proto.start(sends, recvs, phase) if landing is None
                       else self.proto.start_gated(sends, recvs, _ready(out, landing, keep),
                                                   phase))
            keep.do(on_window)
            pending.wait()
        else:  # through a scratch buffer, a few windows in flight, to be thrown away; the
            # save fails (no room for the copy), so this rank's windows go without waiting
            flying: deque[Pending] = deque()
            for k in range(max(len(out), len(into))):
                while len(flying) >= DEPTH - 1:
                    flying.popleft().wait()
                    keep.do(on_window)
                recv = ([(self.buffer(f"in{k % DEPTH}", into[k][1]), source)]
                        if k < len(into) else [])
                flying.append(self.proto.start([(out[k], holder)] if k < len(out) else [],
                                               recv, phase))
            while flying:
                flying.popleft().wait()
                keep.do(on_window)
        return Streamed(dest, keep.error, sum(len(v) for _, v in ranges),
                        int(their[:, 1].sum()) if their_n else 0, time.perf_counter() - t0)

    def seal(self, streamed: Streamed, size: int, metadata: list[tuple[int, bytes]]) -> Moved:
        """After :meth:`stream`, once this rank's shard is sealed (``size`` bytes, 0 if it
        failed): send its HDF5 metadata (``(offset, bytes)`` runs, :mod:`mpickpt.format.h5image`)
        to the holder, receive the source's, and complete and fsync the copy. Raises the first
        error of either leg."""
        holder = partner_holder(self.teams, self.rank)
        source = partner_source(self.teams, self.rank)
        phase = "the partner exchange"
        blob = b"".join(b for _, b in metadata)
        mine = np.array([size, len(metadata), len(blob)], dtype=np.int64)
        theirs = np.zeros(3, dtype=np.int64)
        self.proto.transfer([(mine, holder)], [(theirs, source)], phase)
        their_size, their_k, their_len = (int(x) for x in theirs)
        spans = np.array([[off, len(b)] for off, b in metadata], dtype=np.int64).reshape(-1, 2)
        their = np.zeros((their_k, 2), dtype=np.int64)
        got = np.empty(their_len, dtype=np.uint8)
        self.proto.transfer([(spans, holder), (np.frombuffer(blob, dtype=np.uint8), holder)],
                            [(their, source), (got, source)], phase)
        dest, keep = streamed.dest, _Keep()
        keep.error = streamed.error
        if dest is not None and their_size:
            ends = np.cumsum(their[:, 1])
            keep.do(place, dest.fd, [(int(off), got[end - n:end]) for (off, n), end
                                     in zip(their, ends, strict=True)], their_size)
            keep.do(os.fsync, dest.fd)
        keep.check()
        return Moved(streamed.sent + len(blob), streamed.received + their_len)

    def _xor(self, own: str, size: int, names: Callable[[int], str],
             on_window: Callable[[], None], take: Callable[[str], Mapped]) -> Moved:
        """The parity of a team, window by window: each member's chunks of its shard go out,
        the XOR of the team's chunk for this member comes straight into its parity file (a
        recycled one from ``take``, mapped), two windows in flight."""
        assert self.team_proto is not None
        n = len(self.team)
        chunk = xor_chunk_bytes(self.team_proto.max(size, "the XOR parity"), n)
        src = rootdir.open_regular(own)
        keep = _Keep()
        dst = take(names(self.rank))
        try:
            try:
                dst.reserve(chunk)
            except OSError as e:  # no room for the parity: reduce all the same, then fail
                keep.error = e
            prev: Pending | None = None
            for k, off in enumerate(range(0, chunk, self.window)):
                w = min(self.window, chunk - off)
                out = np.frombuffer(self.buffer(f"out{k % 2}", n * w),
                                    dtype=np.uint8).reshape(n, w)
                for j in range(n):
                    if j == self.pos:
                        out[j] = 0
                    else:
                        _read_padded(src, size, xor_chunk(n, self.pos, j) * chunk + off, out[j])
                into = (dst.view(off, w) if keep.error is None
                        else self.buffer(f"in{k % 2}", w))
                cur = self.team_proto.xor_scatter(out, np.frombuffer(into, dtype=np.uint8),
                                                  "the XOR parity")
                if prev is not None:
                    prev.wait()
                    keep.do(on_window)
                prev = cur
            if prev is not None:
                prev.wait()
                keep.do(on_window)
            keep.do(os.ftruncate, dst.fd, chunk)
            keep.do(os.fsync, dst.fd)
        finally:
            os.close(src)
        keep.check()
        return Moved((n - 1) * chunk, chunk)


def _ready(out: list[memoryview], landing: Landing, keep: _Keep) -> Callable[[int], bool]:
    """Whether window ``k`` of ``out`` has landed in host memory, waiting
    :data:`READY_WAIT_S` at most; a landing that failed is kept as this side's error, and the
    windows go all the same (their bytes are not used: the save fails), so that the partner
    does not wait."""
    def ready(k: int) -> bool:
        if keep.error is not None:
            return True
        addr = np.frombuffer(out[k], dtype=np.uint8).ctypes.data
        try:
            return landing.gate(addr, addr + len(out[k]), READY_WAIT_S)
        except Exception as e:
            keep.error = e
            return True
    return ready


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
              on_window: Callable[[], None] = lambda: None) -> int:
    """Each ``(donor, receiver, path, size)`` in order: the donor sends its file ``path`` out of
    a memory map, the receiver gets it straight into a memory map of its own ``path`` (the
    receiver's). Bytes received."""
    got = 0
    for donor, receiver, path, size in moves:
        if proto.rank in (donor, receiver):
            _copy_one(proto, donor, receiver, path, size, window, on_window)
            got += size if proto.rank == receiver else 0
    return got


def _copy_one(proto: Protocol, donor: int, receiver: int, path: str, size: int,
              window: int, on_window: Callable[[], None]) -> None:
    """One file, every window posted at once (from and into memory maps)."""
    sending = proto.rank == donor
    with _Mapped(path, size, create=not sending) as f:
        views = [(f.view(off, _span(size, off, window)), receiver if sending else donor)
                 for off in range(0, size, window)]
        pending = proto.start(views if sending else [], [] if sending else views,
                              "the rebuild from a partner copy")
        on_window()
        pending.wait()


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
                        pwrite_all(outp, memoryview(recv[k]), off)
                        continue
                    start = xor_chunk(n, lost, k) * chunk + off
                    have = max(0, min(w, sizes[lost] - start))
                    if have:
                        pwrite_all(out, memoryview(recv[k][:have]), start)
        return sizes[lost] + chunk if me == lost else 0
    finally:
        for fd in (src, par):
            if fd >= 0:
                os.close(fd)
        for fd in (out, outp):
            if fd >= 0:
                _seal(fd)
