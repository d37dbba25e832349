"""Copies between host buffers, off torch's thread pool.

torch's ``copy_`` of a CPU tensor runs on torch's OpenMP pool (all the machine's cores by
default), from whichever thread calls it: beside a training thread and mpickpt's I/O threads
that pool oversubscribes the cores, and each copy waits for its slowest thread. On an H200 host
(16 cores) the ring's copy of a 5.84 GB snapshot took 1.0-2.5 s beside training that way, 0.26 s
with the loop stopped, and the training steps lost 0.05-0.08 s per checkpoint to it
(``bench/probe_ring.py``, ``docs/performance.md``). Both copies here use ``memmove`` outside the
interpreter's lock:

- :func:`host_copy`, for copies that run beside training (the ring of
  :mod:`mpickpt.save.landing`; a shard's write into a given destination, the node-local level's,
  :mod:`mpickpt.format.shard`): one ``memmove`` on the calling thread. Split over three more
  threads, the ring's copy cost the training loop of two ranks sharing an H200 one step of
  +165-260 ms per save (+9-11 % at a save every 20 steps); on the calling thread alone +0.3 %,
  and the save was protected sooner (``docs/performance.md``, "The ring's copy and the
  parity's XOR on one thread").
- :func:`copy_into`, the snapshot of tensors in host memory inside ``save()``
  (:mod:`mpickpt.save.snapshot`), while the loop waits for it anyway: on :data:`COPY_THREADS`
  threads from :data:`PART` bytes. Sixteen tensors of 256 KB took 5.4 ms by ``copy_`` on this
  project's 2-core VM, 0.3 ms so. :func:`copy_all` gives torch the small tensors in one call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

COPY_THREADS = 4  # the calling thread and three more
PART = 1 << 20  # the least a thread copies


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for contiguous byte tensors in host memory, by one ``memmove`` on this
    thread (see the module)."""
    n = src.numel()
    if dst.numel() != n or not (dst.is_contiguous() and src.is_contiguous()) \
            or dst.element_size() != 1 or src.element_size() != 1 \
            or dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError("host_copy takes two contiguous byte tensors of one size in host "
                         "memory")
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _copy(d: int, s: int, n: int) -> None:
    """``n`` bytes from address ``s`` to address ``d``, on up to COPY_THREADS threads."""
    part = max(-(-n // COPY_THREADS), PART)
    rest = [_copiers().submit(ctypes.memmove, d + o, s + o, min(part, n - o))
            for o in range(part, n, part)]
    ctypes.memmove(d, s, min(part, n))
    for f in rest:
        f.result()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a host tensor ``dst`` of ``src``'s dtype and shape: by
    ``memmove`` on up to :data:`COPY_THREADS` threads where both are plain contiguous CPU
    tensors, else by torch (a strided view, a conjugate or negative bit, another layout or
    device)."""
    if (src.device.type == "cpu" and dst.device.type == "cpu" and src.dtype == dst.dtype
            and src.shape == dst.shape and src.layout == torch.strided
            and src.is_contiguous() and dst.is_contiguous() and not src.is_conj()
            and not src.is_neg() and not src.is_quantized and src.numel()):
        _copy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


SMALL = 16384  # elements: below half of torch's parallel grain (32768), its copy_ is serial


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`copy_into` for each (``dst``, ``src``); the small ones (under :data:`SMALL`
    elements, which torch copies on the calling thread) in one call into torch
    (``_foreach_copy_``): :func:`copy_into`'s checks were 3.6 µs a tensor on this project's VM,
    29 ms for the 8,000 tensors of a thousand small layers and their Adam state, against 6 ms."""
    dsts, srcs = [], []
    for dst, src in pairs:
        if src.is_cpu and src.numel() < SMALL:
            dsts.append(dst)
            srcs.append(src)
        else:
            copy_into(dst, src)
    if len(dsts) > 1 and _FOREACH_COPY is not None:
        _FOREACH_COPY(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)  # (torch 2.1 on; a loop of copy_ before)


@functools.cache
def _copiers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="mpickpt-copy")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_copiers.cache_clear)  # a child has none of the threads
