"""A restore's bytes on their way to the GPU while they are still being verified.

A restore copies nothing into the state before every rank's checksums have passed (the verify
vote). Where the state's tensors live on a GPU, that order made the copy to the GPU a pass of
its own after the vote, and page-locking the restore's host buffers first (for fast copies)
delayed every transfer into them. With room on the GPU, a :class:`DeviceStage` instead copies
each target's bytes into GPU memory set aside for it as soon as they are in host memory (a
node's own shard mapped where it lies: at once, while its blocks are verified; a lost shard:
as it arrives), from pageable memory, in a thread of its own; after the vote the state's tensors
take them in a device-to-device copy. Nothing reaches the state before the vote; a failed
candidate only drops the GPU memory.

Used by the node-local level's restore (:class:`~mpickpt.restore.restorer.Restorer`); where the
GPU has no room for the staged bytes (free memory less a margin), the restore page-locks its
buffers and copies after the vote, as before.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
from collections.abc import Mapping

import numpy as np
import torch

from ..format import dtypes
from .reshard import Target

MARGIN = 0.10  # of a GPU's memory left free when deciding whether a stage fits
MIN_BYTES = 64 << 20  # below this, staging is not worth its threads
THREADS = 4  # copy threads
CHUNK = 32 << 20  # bytes per copy


class DeviceStage:
    """GPU memory for the targets that go to a GPU, and the copies into it."""

    def __init__(self, targets: Mapping[str, Target], devices: Mapping[str, torch.device]
                 ) -> None:
        self.out: dict[str, torch.Tensor] = {
            n: torch.empty(t.shape, dtype=dtypes.torch_dtype(t.dtype), device=devices[n])
            for n, t in targets.items()}
        self._local = threading.local()  # each copy thread's streams, by device
        self._streams: list[torch.cuda.Stream] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS,
                                                           thread_name_prefix="mpickpt-h2d")
        self._jobs: list[concurrent.futures.Future[None]] = []
        self._queued: set[str] = set()
        self.nbytes = sum(t.nbytes for t in targets.values())  # staged in GPU memory
        self._spans: list[tuple[int, int, str]] = []  # (first, end) address of tracked targets
        self._starts: list[int] = []
        self._covered: dict[str, int] = {}  # bytes of each target that arrived, copied on
        self._lock = threading.Lock()

    @classmethod
    def create(cls, targets: Mapping[str, Target], devices: Mapping[str, torch.device]
               ) -> DeviceStage | None:
        """A stage for the targets whose state tensors are on a CUDA device, or None: no CUDA
        target, too few bytes to matter, or no room on a device (its free memory less
        :data:`MARGIN` of it)."""
        on_gpu = {n: t for n, t in targets.items()
                  if n in devices and devices[n].type == "cuda" and t.nbytes}
        total = sum(t.nbytes for t in on_gpu.values())
        if total < MIN_BYTES:
            return None
        need: dict[torch.device, int] = {}
        for n, t in on_gpu.items():
            need[devices[n]] = need.get(devices[n], 0) + t.nbytes
        for dev, nbytes in need.items():
            free, whole = torch.cuda.mem_get_info(dev)
            if nbytes > free - MARGIN * whole:
                return None
        try:
            return cls(on_gpu, devices)
        except torch.cuda.OutOfMemoryError:  # taken meanwhile: page-lock and copy after the vote
            return None

    def copy(self, name: str, host: torch.Tensor) -> None:
        """Queue the copy of target ``name`` from ``host`` (its bytes, in host memory, not to
        change until :meth:`finish`); a target not staged, or queued already, is ignored."""
        if name not in self.out or name in self._queued:
            return
        self._queued.add(name)
        self._queue(name, 0, host.reshape(-1).view(torch.uint8))

    def _queue(self, name: str, at: int, src: torch.Tensor) -> None:
        """Copy the bytes ``src`` to target ``name`` from byte ``at`` on, in pieces of
        :data:`CHUNK` spread over the copy threads (a copy from pageable memory goes through
        the driver's staging buffers at the speed of one CPU thread)."""
        flat = self.out[name].view(-1).view(torch.uint8)
        for a in range(0, src.numel(), CHUNK):
            piece = src[a: a + CHUNK]
            self._jobs.append(self._pool.submit(
                self._run, name, flat[at + a: at + a + piece.numel()], piece))

    def _run(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        streams = self._local.__dict__.setdefault("streams", {})
        if dst.device not in streams:
            streams[dst.device] = torch.cuda.Stream(dst.device)
            self._streams.append(streams[dst.device])
        with torch.cuda.stream(streams[dst.device]):
            dst.copy_(src)
        with self._lock:
            self._covered[name] = self._covered.get(name, 0) + src.numel()

    def track(self, hosts: Mapping[str, torch.Tensor]) -> None:
        """The targets' host tensors (views of the restore's buffer), so that :meth:`arrived`
        can tell which target a received piece belongs to."""
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
                       for n, t in hosts.items() if n in self.out and t.numel())
        self._spans, self._starts = spans, [lo for lo, _, _ in spans]

    def arrived(self, piece: np.ndarray | torch.Tensor) -> None:
        """Bytes of a tracked target that have arrived (an array viewing them in the target's
        host tensor): their copy is queued; others are ignored. Never blocks (the transfer
        thread calls it)."""
        t = torch.from_numpy(piece) if isinstance(piece, np.ndarray) else piece
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        k = bisect.bisect_right(self._starts, ptr) - 1
        if k < 0 or not n or ptr + n > self._spans[k][1]:
            return
        lo, _, name = self._spans[k]
        self._queue(name, ptr - lo, t.reshape(-1).view(torch.uint8))

    def finish(self, arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy from ``arrays`` the targets not queued whole or arrived whole, wait for every
        copy (raising the first one's failure), and return ``arrays`` with the staged targets
        in GPU memory."""
        try:
            self._wait()
            for name, t in self.out.items():
                if name not in self._queued and \
                        self._covered.get(name, 0) < t.numel() * t.element_size():
                    self.copy(name, arrays[name])
            self._wait()
        finally:
            self.close()
        return {**arrays, **self.out}

    def _wait(self) -> None:
        for job in self._jobs:
            job.result()
        for stream in list(self._streams):
            stream.synchronize()

    def close(self) -> None:
        """Wait for the copies queued (host buffers are about to be reused), end the thread."""
        concurrent.futures.wait(self._jobs)
        self._pool.shutdown(wait=True)
