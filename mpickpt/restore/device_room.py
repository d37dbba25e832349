"""GPU memory set aside for a restore: filled while the bytes come over MPI, or block by block
as they are read from files (ROOT's, or a node's own shards in memory) and verified; taken by
the state device to device once every rank has verified what it holds.

A restore from the node-local level after a lost node waits for the lost shard's bytes from
its partner. Through host memory, the state can take them only after they are all in and
verified, and then after page-locking a buffer as large as the shard. With room on the GPU,
the received bytes go through a small ring of page-locked slots (:mod:`mpickpt.local.ring`),
verified there and copied into the room while the next ones move; after the verify vote the
state copies from GPU memory. Nothing of the state changes before that vote, as before.

Files are read block by block into one of a few page-locked buffers, no more than there are
I/O threads (:class:`Bounce`), verified there and copied into the room: no host buffer as
large as the state to fault in and page-lock first (0.3-0.4 s for 5.84 GB on an H200 host,
though the buffer was the saves' and faulted in already). A node's own shard in memory takes
the same way rather than being mapped where it lies: mapped, its pages were faulted into the
process one by one by the verify's threads and page-locked once more for the copy, beside the
serving of a lost node's copy out of another mapping; on one H200 host that read took 1.4 s
for 3 GB (``docs/performance.md``). (Without the room, it is still used where it lies.)

A tensor the state does not hold yet (a restarted job's fresh optimizer state), saved from a
GPU, gets room of its own (:meth:`DeviceRoom.buffers`), which the state keeps as it is: no
host buffer, no second copy on the GPU (``Plan.fresh``, ``Staged.owned``).

Used only where the GPU has the room free (with :data:`HEADROOM` to spare), a target's bytes
are uncompressed, and ``MPICKPT_RESTORE_GPU_ROOM`` is not 0; otherwise the restore goes through
host memory as it did.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from .. import knobs
from ..format.iothreads import pool
from ..local.ring import Ring, pinned_ring
from ..save.pinned_pool import HostPool

HEADROOM = 1 << 30  # bytes of the GPU left free, at least, when room is set aside

log = logging.getLogger("mpickpt")


class DeviceRoom:
    """Room on ``device`` for the targets whose bytes come from other ranks (``fetched(rank)``)
    or are read from files (ROOT's, or the node's own shards in memory, which are then not
    mapped)."""

    def __init__(self, device: torch.device, fetched: Callable[[int], bool]) -> None:
        self.device, self.fetched = device, fetched
        self.held: list[torch.Tensor] = []
        self.ring: Ring | None = None  # the received bytes' way in (take_ring)
        self.bounce: Bounce | None = None  # the bytes read from files' way in (take_bounce)
        self._let_go: Callable[[], None] | None = None

    @classmethod
    def find(cls, devices: dict[str, torch.device], fetched: Callable[[int], bool]
             ) -> DeviceRoom | None:
        """For the GPU that holds most of the state's targets (``devices``), if any."""
        cuda = Counter(d for d in devices.values() if d.type == "cuda")
        if not cuda or not torch.cuda.is_available() or not knobs.RESTORE_GPU_ROOM.get():
            return None
        return cls(cuda.most_common(1)[0][0], fetched)

    def buffers(self, sizes: list[int]) -> list[torch.Tensor] | None:
        """GPU memory of each of ``sizes`` bytes, or None where the GPU does not have them all
        free."""
        free, _ = torch.cuda.mem_get_info(self.device)
        if sum(sizes) + HEADROOM > free:
            log.debug("restore: %d bytes of %s free, %d wanted: through host memory", free,
                      self.device, sum(sizes))
            return None
        try:
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        except torch.cuda.OutOfMemoryError:
            return None
        self.held += bufs
        return bufs

    def take_ring(self, block: int, pin: bool) -> None:
        """A ring for the bytes received into the room (checksum blocks of ``block`` bytes;
        page-locked where ``pin``): :attr:`ring`."""
        self.ring, self._let_go = pinned_ring(block, pin)

    def take_bounce(self, block: int, threads: int, pin: bool) -> Bounce:
        """Page-locked buffers (where ``pin``) for the blocks of ``block`` bytes that
        ``threads`` I/O threads read from files into the room: :attr:`bounce`."""
        self.bounce = Bounce(block, threads, pin)
        return self.bounce

    def close(self) -> None:
        """Let the ring and the bounce buffers go, on a background thread (unlocking and
        freeing page-locked memory takes tens of ms the restore need not wait for), and the
        room back to the GPU (every view of it dropped before)."""
        host = [f for f in (self._let_go, self.bounce.close if self.bounce else None) if f]
        self.ring = self._let_go = self.bounce = None
        if host:
            pool(1, background=True).submit(_let_go, host)
        if self.held:
            self.held.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def _let_go(closes: list[Callable[[], None]]) -> None:
    for close in closes:
        try:
            close()
        except Exception as e:  # (memory a restore no longer uses: said, not raised)
            log.warning("restore: letting its page-locked buffers go failed: %s", e)


class Bounce:
    """Page-locked host buffers of ``size`` bytes, at most ``threads`` of them, through which
    the blocks a restore reads from files reach their room on the GPU
    (:func:`mpickpt.format.reader.read_spans`): a copy into the GPU from page-locked memory,
    without a host buffer as large as the state. Each block holds one while it is read,
    verified and copied (``with bounce() as buf``), then gives it back: whichever threads
    read (the I/O threads, or the caller, for a file of one block), a block waits at most for
    another to finish."""

    def __init__(self, size: int, threads: int, pin: bool) -> None:
        self.size = size
        self._pool = HostPool(size * threads, slots=threads, pin=pin)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[torch.Tensor]:
        buf = self._pool.acquire(self.size)
        try:
            self._pool.lock(buf)  # once per buffer (it stays locked until close)
            yield buf
        finally:
            self._pool.release(buf)

    def close(self) -> None:
        """Every buffer unlocked and let go (every block's read over)."""
        self._pool.close()
