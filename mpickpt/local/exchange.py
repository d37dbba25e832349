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
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format import rootdir
from ..format.h5image import place
from ..mpi.protocol import Pending, Protocol
from ..save.landing import Landing
from . import xorring
from .pool import Mapped
from .topology import partner_holder, partner_source, team_of, xor_chunk, xor_chunk_bytes

WINDOW = 32 << 20
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14
POPULATE_PIECE = 64 << 20
DEPTH = 4  # partner windows in flight
READY_WAIT_S = 0.05  # a window not landed yet: the deadline is looked at this often meanwhile


class _Mapped:
    """A file as a shared memory map (``create``: made, its blocks allocated first, so that a
    full disk is an error here rather than a SIGBUS later; fsynced when it closes)."""

    def __init__(self, path: str, size: int, create: bool = False) -> None:
        self.path, self.size, self.create = path, size, create
        self._map: mmap.mmap | None = None
        self._arr: np.ndarray | None = None
        self._populating: threading.Thread | None = None

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

    def populate(self) -> None:
        """Map the file's pages in ahead of their use, on a thread of its own, from the start
        (``MADV_POPULATE_WRITE``/``_READ``, Linux 5.14): MPI's copies into them and the XOR's
        reads then take no page fault at each page. Where the kernel cannot, nothing happens;
        the map is closed only after it (``__exit__``)."""
        if self._map is None:
            return
        m, advice = self._map, MADV_POPULATE_WRITE if self.create else MADV_POPULATE_READ

        def run() -> None:
            for a in range(0, self.size, POPULATE_PIECE):
                try:
                    m.madvise(advice, a, min(POPULATE_PIECE, self.size - a))
                except (OSError, ValueError):  # an older kernel, or the map gone
                    return

        self._populating = threading.Thread(target=run, daemon=True, name="mpickpt-populate")
        self._populating.start()

    def __exit__(self, *exc: object) -> None:
        if self._populating is not None:
            self._populating.join()
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
        for slot in range(xorring.BUFFERS if scheme == "xor" else DEPTH):
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
        """The parity of a team over the ring (:mod:`mpickpt.local.xorring`): each member's
        chunks of its shard go out of its file's map, the XOR of the team's chunks for this
        member comes straight into its parity file (a recycled one from ``take``, mapped)."""
        assert self.team_proto is not None
        n = len(self.team)
        chunk = xor_chunk_bytes(self.team_proto.max(size, "the XOR parity"), n)
        keep = _Keep()
        dst = take(names(self.rank))
        try:
            dst.reserve(chunk)
        except OSError as e:  # no room for the parity: pass the blocks on all the same, then fail
            keep.error = e
        me = self.pos

        def into(b: xorring.Block) -> np.ndarray:
            return np.frombuffer(dst.view(b.off, b.n) if keep.error is None
                                 else self.buffer("scratch", self.window)[:b.n], dtype=np.uint8)

        with _Mapped(own, size) as src:
            src.populate()
            xorring.ring(self.team_proto, xorring.interleave(
                [xorring.blocks([k], chunk, self.window) for k in range(n)]),
                lambda b: _padded(src, xor_chunk(n, me, b.k) * chunk + b.off, b.n),
                into, xorring.passing(self.buffer, self.window), "the XOR parity",
                lambda: keep.do(on_window))
        keep.do(os.ftruncate, dst.fd, chunk)
        keep.do(os.fsync, dst.fd)
        keep.check()
        return Moved((n - 1) * chunk, (n - 1) * chunk)


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


def _padded(src: _Mapped, start: int, n: int) -> np.ndarray:
    """Bytes ``[start, start + n)`` of a file mapped read-only, where it lies; a copy with
    zeros past the file's end."""
    have = max(0, min(n, src.size - start))
    if have == n:
        return src.view(start, n)
    out = np.zeros(n, dtype=np.uint8)
    if have:
        out[:have] = src.view(start, have)
    return out


def _span(size: int, off: int, window: int) -> int:
    return max(0, min(window, size - off))


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
                window: int, buffer: Callable[[str, int], memoryview],
                on_window: Callable[[], None] = lambda: None, shard: bool = True,
                parity_too: bool = True) -> int:
    """Rebuild the shard and (``parity_too``) the parity of team position ``lost`` on that
    member, from the others' shards (``own``) and parities, over the ring
    (:mod:`mpickpt.local.xorring`): every block ends at the lost member, straight in its new
    files' maps, the shard's blocks in file order and then the parity's (without ``shard``,
    the parity alone). Collective over ``team``. Bytes received."""
    n, me = team.size, team.rank
    shard_order = sorted((k for k in range(n) if k != lost), key=lambda k: xor_chunk(n, lost, k))
    order = xorring.blocks([*(shard_order if shard else []), *([lost] if parity_too else [])],
                           chunk, window)
    keep = _Keep()  # a file that cannot be had: zeros or a scratch buffer, the error after
    with contextlib.ExitStack() as files:

        def opened(path: str | None, size: int, create: bool = False) -> _Mapped | None:
            if path is None or keep.error is not None:
                return None
            try:
                f = files.enter_context(_Mapped(path, size, create=create))
            except OSError as e:
                keep.error = e
                return None
            f.populate()
            return f

        mine = me == lost  # its shard's map as long as its chunks, cut to size once filled
        out = opened(out_shard, (n - 1) * chunk, True) if mine and shard else None
        par = opened(out_parity, chunk, True) if mine and parity_too else None
        src = opened(own, sizes[me]) if not mine else None
        par_src = opened(parity, chunk) if not mine and shard else None

        def contribution(b: xorring.Block) -> np.ndarray:
            f, at = (par_src, b.off) if me == b.k else (src, xor_chunk(n, me, b.k) * chunk + b.off)
            return _padded(f, at, b.n) if f is not None else np.zeros(b.n, dtype=np.uint8)

        def into(b: xorring.Block) -> np.ndarray:
            f, at = (par, b.off) if b.k == lost else (out, xor_chunk(n, lost, b.k) * chunk + b.off)
            return f.view(at, b.n) if f is not None else \
                np.frombuffer(buffer("scratch", window), dtype=np.uint8)[:b.n]

        xorring.ring(team, order, contribution, into, xorring.passing(buffer, window),
                     "the XOR rebuild", on_window, ends=lambda _: lost)
        if out is not None:
            keep.do(os.ftruncate, out.fd, sizes[lost])
    keep.check()
    return (sizes[lost] * shard + chunk * parity_too) if me == lost else 0
