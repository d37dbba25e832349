"""A lost shard's bytes, rebuilt from XOR parity, landed straight where the restore wants them.

When a node is lost and its ranks' shards come back from their XOR teams
(:func:`mpickpt.local.parity.xor_rebuild`), the rebuilt bytes reach the lost member in file
order, a block of the ring at a time. Written into a new file first, they would be faulted into
fresh pages (0.8 s for a 2 GB shard on an H200 host, as long as the transfer itself) and read
again by the load. :class:`XorLanding` instead receives each block into one of a few buffers used
again and again, and on a thread of its own, in order, copies its bytes into the spans the
restore planned (a staging buffer, or the room set aside on the GPU) and hashes each checksum
block as its bytes pass, against the manifest. The files go back to the node after the restore
(:meth:`mpickpt.local.recovery.LocalRecovery.write_back`).

Only uncompressed records are taken this way (:func:`landable_shard`); a shard with others is
rebuilt into its file first, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..errors import ShardError
from ..format import checksum
from ..format.entry import RankEntry
from ..format.reader import Span


def landable_shard(entry: RankEntry) -> bool:
    """Whether a shard's records can land straight in the restore: every one uncompressed and
    in the shard's own file (not an older one's, as an incremental save may leave them)."""
    return all(r.codec is None and r.source is None for r in entry.tensors)


class _Fed:
    """One span as its bytes come, in order: how many came, the running hash of the checksum
    block they are in."""

    def __init__(self, span: Span) -> None:
        self.span, self.got = span, 0
        self.start = span.record.offset + span.lo  # in the file
        self.end = self.start + span.nbytes
        self.hash = checksum.hasher()


class XorLanding:
    """Rank ``rank``'s shard (``path`` names it in errors; ``size`` bytes) landing in
    ``spans`` (uncompressed, whole checksum blocks of ``block`` bytes) through uint8 CPU
    tensors used again and again: ``buffers`` gives each, when called (each is asked for only
    when a block finds no used one free, and again each time it is free after use: where it
    gives a page-locked twin by then, the twin is used from then on, and the copies into the
    GPU go at the link's speed instead of through the driver's staging).

    The ring calls :meth:`into` for where a block of the file is to be received (it waits for
    a buffer free) and :meth:`arrived` once it is in, in the same order; :meth:`finish` waits for
    every block to be used and says what failed, if anything: a checksum that does not match,
    bytes that never came."""

    def __init__(self, rank: int, path: str, size: int, spans: list[Span], block: int,
                 buffers: list[Callable[[], torch.Tensor]]) -> None:
        self.rank, self.path, self.size, self.block = rank, path, size, block
        self._fed = sorted((_Fed(s) for s in spans if s.nbytes), key=lambda f: f.start)
        self._first = 0
        self._buffers = buffers
        self._fresh = deque(range(len(buffers)))
        self._free: deque[tuple[torch.Tensor, int]] = deque()
        self._cond = threading.Condition()
        self._coming: deque[tuple[int, int, torch.Tensor, int]] = deque()
        self._used: list[Future[None]] = []
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-landing")
        self.error: Exception | None = None
        self.received = 0

    def into(self, at: int, n: int) -> np.ndarray:
        """Where bytes ``[at, at + n)`` of the shard's file are to be received."""
        with self._cond:
            fresh = self._fresh.popleft() if not self._free and self._fresh else None
            while fresh is None and not self._free:
                self._cond.wait()
            buf, k = self._free.popleft() if fresh is None else (None, fresh)
        if buf is None:  # (outside the lock: a buffer used meanwhile is given back)
            buf = self._buffers[k]()
        if buf.numel() < n:
            raise ValueError(f"a landing buffer of {buf.numel()} bytes for a block of {n}")
        self._coming.append((at, n, buf, k))
        return buf[:n].numpy()

    def arrived(self) -> None:
        """The oldest block :meth:`into` gave a buffer for is in: used on the landing's thread,
        its buffer free again after."""
        at, n, buf, k = self._coming.popleft()
        self.received += max(0, min(n, self.size - at))
        self._used.append(self._worker.submit(self._use, at, n, buf, k))

    def _use(self, at: int, n: int, buf: torch.Tensor, k: int) -> None:
        try:
            if self.error is None:
                self._land(at, min(n, max(0, self.size - at)), buf)
            buf = self._buffers[k]()  # its page-locked twin, once there is one
        except Exception as e:
            self.error = self.error or e
        finally:
            with self._cond:
                self._free.append((buf, k))
                self._cond.notify()

    def _land(self, at: int, n: int, buf: torch.Tensor) -> None:
        """Bytes ``[at, at + n)`` of the file, in ``buf``: into every span they fall in,
        hashed there block by block."""
        fed, end = self._fed, at + n
        while self._first < len(fed) and fed[self._first].end <= at:
            self._first += 1
        for f in fed[self._first:]:
            if f.start >= end:
                break
            lo, hi = max(at, f.start), min(end, f.end)
            if lo >= hi:
                continue
            if lo != f.start + f.got:
                raise ShardError(self.rank, self.path, f"bytes {lo}..{hi} came before bytes "
                                 f"{f.start + f.got}..{lo} of it", tensor=f.span.record.name)
            piece = buf[lo - at:hi - at]
            self._hash(f, piece.numpy())
            f.span.dest[lo - f.start:hi - f.start].copy_(piece)
            f.got += hi - lo

    def _hash(self, f: _Fed, data: np.ndarray) -> None:
        """``data`` (the span's next bytes) into its running hashes, each checksum block
        checked as it is complete."""
        rec, block, pos = f.span.record, self.block, f.span.lo + f.got  # in the record
        done = 0
        while done < len(data):
            block_end = min((pos // block + 1) * block, rec.nbytes)
            take = min(len(data) - done, block_end - pos)
            f.hash.update(data[done:done + take])
            done, pos = done + take, pos + take
            if pos == block_end:
                n = (pos - 1) // block
                if f.hash.hexdigest() != rec.checksums[n]:
                    at = rec.offset + n * block
                    raise ShardError(self.rank, self.path, f"checksum mismatch in block {n} "
                                     f"(bytes {at}..{rec.offset + pos}) as its XOR team rebuilt "
                                     "it: the data is corrupt", tensor=rec.name)
                f.hash = checksum.hasher()

    def finish(self) -> Exception | None:
        """Wait until every block that arrived is used; what failed, or None."""
        for fut in self._used:
            fut.result()
        self._worker.shutdown()
        if self.error is None:
            short = next((f for f in self._fed if f.got != f.span.nbytes), None)
            if short is not None:
                self.error = ShardError(self.rank, self.path, f"only {short.got} of the "
                                        f"{short.span.nbytes} bytes from {short.start} came "
                                        "from its XOR team", tensor=short.span.record.name)
        return self.error

    def abandon(self) -> None:
        """The ring failed: what is still queued is not used."""
        self.error = self.error or RuntimeError("the XOR rebuild stopped")
        self._worker.shutdown(wait=True, cancel_futures=True)
