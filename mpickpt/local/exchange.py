"""Redundancy for the node-local level, over MPI: partner copies and XOR parity.

The protocol layer's data plane (:mod:`mpickpt.mpi.protocol` holds every MPI call): files stream
through two buffers of ``window`` bytes that are allocated once and reused by every checkpoint,
each transfer within the protocol's deadline. The layout rules (who protects whom, how XOR cuts
a shard into chunks) are :mod:`mpickpt.local.topology`'s.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .. import knobs
from ..format.h5image import place
from ..mpi.protocol import Pending, Protocol
from ..save.landing import Landing
from . import parity, xordirect, xorring
from .filemap import FileMap, Keep
from .pool import Mapped
from .topology import partner_holder, partner_source, team_of, xor_chunk_bytes

WINDOW = 32 << 20
DEPTH = 4  # partner windows in flight
READY_WAIT_S = 0.05  # a window not landed yet: the deadline is looked at this often meanwhile


@dataclass
class Moved:
    """What one rank sent and received over the network."""

    sent: int = 0
    received: int = 0


@dataclass
class Streamed:
    """A stream's outcome: the partner copy's or the parity's file (None if it could not be
    made), the first error of this side, the tensor bytes sent and received."""

    dest: Mapped | None
    error: BaseException | None
    sent: int
    received: int
    seconds: float = 0.0  # from the start of the stream to its end, the partner's wait included
    chunk: int = 0  # XOR: the parity's bytes, when its tensors' part went from the snapshot


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

    def parity_stream(self, runs: list[parity.Run] | None, size: int,
                      take: Callable[[int], Mapped], on_window: Callable[[], None],
                      landing: Landing | None = None) -> Future[Streamed]:
        """XOR, pass 1 (:mod:`mpickpt.local.parity`): start this rank's part of its team's
        parity of the tensor bytes (``runs``, straight from the snapshot, by offset; ``size``:
        the shard file's, which its layout fixes), into ``take(rank)`` (its parity file,
        recycled and mapped), on the exchange's own thread while the shard is written; with a
        ``landing``, each run once it has landed in host memory. ``runs`` None (a layout
        without a template, or none): the whole team makes its parity from the shard files
        after the write, in :meth:`parity_seal`, which completes the parity either way."""
        return self._streamer.submit(self._parity_stream, runs, size, take, on_window, landing)

    def _parity_stream(self, runs: list[parity.Run] | None, size: int,
                       take: Callable[[int], Mapped], on_window: Callable[[], None],
                       landing: Landing | None) -> Streamed:
        t0 = time.perf_counter()
        assert self.team_proto is not None
        largest, files = self.team_proto.maxes([size, int(runs is None)], "the XOR parity")
        chunk = xor_chunk_bytes(largest, len(self.team))
        keep, dest = Keep(), None
        try:
            dest = take(self.rank)
            dest.reserve(chunk)
        except Exception as e:  # no room for the parity: pass the blocks on all the same
            keep.error = e
        if files:
            return Streamed(dest, keep.error, 0, 0, time.perf_counter() - t0)
        if landing is not None and runs and knobs.XOR_LAND_BY_ROUNDS.get():
            # land the blocks in the order the rounds take them
            landing.prefer(parity.landing_order(runs, len(self.team), self.pos, chunk,
                                                xordirect.block_bytes(len(self.team),
                                                                      self.window)))
        parts = parity.snapshot_parts(runs or [], landing.gate if landing else None, keep)
        parity.from_snapshot(self.team_proto, chunk, parts, self._into(dest, keep), self.buffer,
                             self.window, lambda: keep.do(on_window))
        moved = (len(self.team) - 1) * chunk
        return Streamed(dest, keep.error, moved, moved, time.perf_counter() - t0, chunk)

    def parity_seal(self, streamed: Streamed, own: str, size: int,
                    metadata: list[tuple[int, bytes]], on_window: Callable[[], None]) -> Moved:
        """XOR, after :meth:`parity_stream` and once every rank has written its shard (``own``,
        ``size`` bytes; ``metadata``: its HDF5 metadata runs): pass 2, the team's metadata XORed
        into the parity; or, where the tensors' bytes did not go from the snapshot (or a
        shard's size is not the one its layout gave), the whole parity from the shard files.
        The parity file is then cut to its size and fsynced. Collective over the team."""
        assert self.team_proto is not None
        n, keep, dest, chunk = len(self.team), Keep(), streamed.dest, streamed.chunk
        keep.error = streamed.error
        moved = Moved(streamed.sent, streamed.received)
        if chunk:
            got = self.team_proto.allgather((size, metadata), "the XOR parity")
            if xor_chunk_bytes(max(s for s, _ in got), n) != chunk:
                chunk = 0
            elif keep.error is None and dest is not None:
                keep.do(parity.add_metadata, np.frombuffer(dest.view(0, chunk), dtype=np.uint8),
                        chunk, self.pos, [runs for _, runs in got])
                moved.sent += sum(len(b) for _, b in metadata)
        if not chunk:
            chunk = xor_chunk_bytes(self.team_proto.max(size, "the XOR parity"), n)
            if keep.error is None and dest is not None:
                keep.do(dest.reserve, chunk)
            parity.from_files(self.team_proto, own, size, chunk, self._into(dest, keep),
                              self.buffer, self.window, lambda: keep.do(on_window))
            moved = Moved((n - 1) * chunk, (n - 1) * chunk)
        if dest is not None:
            keep.do(os.ftruncate, dest.fd, chunk)
            keep.do(os.fsync, dest.fd)
        keep.check()
        return moved

    def _into(self, dest: Mapped | None, keep: Keep) -> parity.Into:
        """Where a parity block lands: its place in ``dest``, or a scratch buffer once this
        side has failed (the blocks still go round, so that no member waits)."""
        def into(b: xorring.Block) -> np.ndarray:
            if keep.error is None and dest is not None:
                return np.frombuffer(dest.view(b.off, b.n), dtype=np.uint8)
            return np.frombuffer(self.buffer("scratch", self.window), dtype=np.uint8)[:b.n]
        return into

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
        keep, dest = Keep(), None
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
        dest, keep = streamed.dest, Keep()
        keep.error = streamed.error
        if dest is not None and their_size:
            ends = np.cumsum(their[:, 1])
            keep.do(place, dest.fd, [(int(off), got[end - n:end]) for (off, n), end
                                     in zip(their, ends, strict=True)], their_size)
            keep.do(os.fsync, dest.fd)
        keep.check()
        return Moved(streamed.sent + len(blob), streamed.received + their_len)


def _ready(out: list[memoryview], landing: Landing, keep: Keep) -> Callable[[int], bool]:
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


def _stand_in(proto: Protocol, peer: int, sending: bool, size: int, window: int) -> None:
    """The windows of a copy this side cannot map, to or from one scratch buffer in turn."""
    scratch = memoryview(bytearray(max(1, min(window, size))))
    for off in range(0, size, window):
        view = [(scratch[:_span(size, off, window)], peer)]
        proto.start(view if sending else [], [] if sending else view,
                    "the rebuild from a partner copy").wait()


def _copy_one(proto: Protocol, donor: int, receiver: int, path: str, size: int,
              window: int, on_window: Callable[[], None]) -> None:
    """One file, every window posted at once (from and into memory maps)."""
    sending = proto.rank == donor
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(FileMap(path, size, create=not sending))
        except OSError:  # (a truncated copy): the windows go all the same, so that the other
            _stand_in(proto, receiver if sending else donor, sending, size, window)
            raise  # side does not wait for them; the bytes fail its verification
        views = [(f.view(off, _span(size, off, window)), receiver if sending else donor)
                 for off in range(0, size, window)]
        pending = proto.start(views if sending else [], [] if sending else views,
                              "the rebuild from a partner copy")
        on_window()
        pending.wait()
