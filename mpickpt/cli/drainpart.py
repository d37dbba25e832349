"""``mpickpt drain``: one process's part. Each :class:`CopyJob` verifies a rank's shard in a node
directory (every checksum, against the manifest the drain was planned with) and copies it to
ROOT; :func:`copy_share` runs this process's jobs a few at a time and says what became of each
(:class:`Copied`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ManifestError, ShardError
from ..format import checksum, rootdir
from ..format.blocks import verify_file
from ..format.manifest import NAME as MANIFEST
from ..format.manifest import Manifest
from .local import read_manifest


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Verify rank ``rank``'s shard at ``src`` (every checksum) against the MANIFEST.json beside
    it, which must hash to ``digest``, then copy it to ``dst``."""

    rank: int
    src: str
    dst: str
    digest: str


@dataclass(frozen=True, slots=True)
class Copied:
    """What became of a :class:`CopyJob`: ``damaged`` says why ``src`` failed verification
    (another copy may serve), ``error`` why the copy itself failed (the drain stops)."""

    rank: int
    src: str
    damaged: str | None
    error: str | None
    nbytes: int


def copy_file(src: str, dst: str, on_bytes: Callable[[int], None] | None = None) -> int:
    """Copy ``src`` (a regular file, never through a link) to ``dst`` and fsync it; the bytes
    copied."""
    return rootdir.copy_file(src, dst, on_bytes)


def copy_share(jobs: list[CopyJob], threads: int,
               on_bytes: Callable[[int], None] | None = None) -> list[Copied]:
    """This process's part of a drain: each job's shard verified, then copied; jobs run
    ``threads`` at a time."""
    if not jobs:
        return []
    manifests: dict[str, Manifest | str] = {}
    for d in {os.path.dirname(j.src) for j in jobs}:
        try:
            m, data = read_manifest(d)
            manifests[d] = m if checksum.digest(data) == jobs[0].digest else (
                f"{os.path.join(d, MANIFEST)} is no longer the manifest the drain was planned "
                "with (did a job write this step again?)")
        except ManifestError as e:
            manifests[d] = str(e)
    workers = max(1, min(threads, len(jobs)))

    def one(job: CopyJob) -> Copied:
        m = manifests[os.path.dirname(job.src)]
        if isinstance(m, str):
            return Copied(job.rank, job.src, f"rank {job.rank}: {job.src}: {m}", None, 0)
        entry = m.ranks[job.rank]
        try:
            verify_file(job.rank, job.src, entry.bytes, entry.tensors, m.checksum_block,
                        threads=max(1, threads // workers))
        except ShardError as e:
            return Copied(job.rank, job.src, str(e), None, 0)
        try:
            n = copy_file(job.src, job.dst, on_bytes)
        except OSError as e:
            why = e.strerror or str(e)
            return Copied(job.rank, job.src, None,
                          f"rank {job.rank}: copying {job.src} to {job.dst}: {why}", 0)
        return Copied(job.rank, job.src, None, None, n)

    with ThreadPoolExecutor(workers, thread_name_prefix="mpickpt-drain") as pool:
        return list(pool.map(one, jobs))
