"""A compressed shard's blocks: each compressed on the I/O threads (hashed first, unless its
checksum is known), handed to HDF5 in order, a few ahead, and its frame written by the threads
where HDF5 placed it (:mod:`mpickpt.format.framesink`); then each chunk's place in the file.

While the snapshot still lands in host memory (``gate``), the blocks go in the order of their
addresses, each compressed as soon as it has landed.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import Any

from . import checksum, codec, dtypes
from .framesink import FrameSink, FrameWriter
from .h5layout import let_others_run
from .iothreads import pool
from .records import TensorRecord


def write(records: Sequence[TensorRecord], datasets: Sequence[Any], sink: FrameSink | None,
          fds: tuple[int, int], views: Sequence[memoryview], block: int, threads: int,
          on_block: Callable[[], None] | None, known: list[bool],
          gate: Callable[[int, int], None] | None = None,
          addrs: list[int] | None = None) -> None:
    """Every block of the records with a codec, from ``views`` (a record's bytes each) into
    HDF5's ``datasets`` on ``threads`` threads; ``fds``: the file's descriptors (page cache,
    ``O_DIRECT`` or -1). With ``gate``, each block once ``gate(start, end)`` returns for its
    addresses (``addrs``: each record's first byte's). Fills each record's checksums and
    ``chunks``."""
    jobs = [(i, b) for i, r in enumerate(records) if r.codec is not None
            for b in range(checksum.block_count(r.nbytes, block))]
    if gate is not None and addrs is not None:
        jobs.sort(key=lambda j: addrs[j[0]] + j[1] * block)
    sizes = {i: (dtypes.itemsize(r.dtype),
                 codec.chunk_elements(r.nbytes, dtypes.itemsize(r.dtype), block))
             for i, r in enumerate(records) if r.codec is not None}

    workers = pool(threads, True) if threads > 1 else None
    ahead = max(2 * threads, 2)
    frames = FrameWriter(sink, fds[0], fds[1], codec.max_frame(block), workers, max(threads, 1))

    def compress(i: int, b: int) -> tuple[str | None, mmap.mmap, int]:
        r, raw = records[i], views[i][b * block: (b + 1) * block]
        if gate is not None and addrs is not None:
            gate(addrs[i] + b * block, addrs[i] + b * block + len(raw))
        item, elems = sizes[i]
        digest = None if known[i] else checksum.digest(raw)
        buf = frames.buffers.take()
        return digest, buf, codec.compress_into(r.codec or "", raw, elems * item, item,
                                                memoryview(buf))

    pending = [workers.submit(compress, *j) if workers else None for j in jobs[:ahead]]
    try:
        for k, (i, b) in enumerate(jobs):
            fut, pending[k] = pending[k], None  # its frame's buffer reused once written
            digest, buf, n = fut.result() if fut else compress(i, b)
            if workers and k + ahead < len(jobs):
                pending.append(workers.submit(compress, *jobs[k + ahead]))
            if digest is not None:
                records[i].checksums[b] = digest
            frames.put(datasets[i], (b * sizes[i][1],), buf, n)
            let_others_run()
            if on_block is not None:
                on_block()
        frames.finish()
    except BaseException:
        for fut in pending:
            if fut is not None:
                fut.cancel()
        frames.abandon()
        raise
    for i, r in enumerate(records):
        if r.codec is not None:
            ds, elems = datasets[i], sizes[i][1]
            infos = [ds.get_chunk_info_by_coord((b * elems,))
                     for b in range(checksum.block_count(r.nbytes, block))]
            r.chunks = [[int(x.byte_offset), int(x.size)] for x in infos]
            let_others_run()
