"""Whose shard is it? The sentence for a shard that fails verification because it is another's.

A shard swapped between ranks, or copied in from another checkpoint, fails the size or checksum
check like any damage. :func:`explain` says where it came from: it compares the file with the
other ranks' entries of the same manifest, then with every rank's entry of the nearest other
committed checkpoints under ROOT (at most :data:`MAX_MANIFESTS`, each manifest at most
:data:`MAX_MANIFEST_BYTES`). An entry matches when the file has its exact size and the first
checksum block of each of its smallest tensors matches (at most :data:`PROBES` tensors and
:data:`PROBE_BYTES` bytes read), while the file does not match its own entry that way (then the
damage is elsewhere and nothing is claimed). Only manifests and byte ranges are read, never HDF5,
and only after a failure.
"""

from __future__ import annotations

import os

from ..errors import ManifestError
from ..format import checksum, rootdir
from ..format.entry import RankEntry
from ..format.manifest import Manifest, read_bytes

PROBES = 64
PROBE_BYTES = 4 << 20
MAX_MANIFESTS = 4
MAX_MANIFEST_BYTES = 64 << 20


def _matches(fd: int, size: int, entry: RankEntry, block: int) -> bool:
    """Whether the open file has ``entry``'s size and the checksums of its smallest tensors."""
    if size != entry.bytes:
        return False
    probed, budget = 0, PROBE_BYTES
    for r in sorted((r for r in entry.tensors if r.nbytes and r.checksums
                     and r.codec is None and r.source is None),
                    key=lambda r: r.nbytes)[:PROBES]:
        n = min(block, r.nbytes)
        if n > budget:
            break
        budget -= n
        data = os.pread(fd, n, r.offset)
        if len(data) != n or checksum.digest(data) != r.checksums[0]:
            return False
        probed += 1
    return probed > 0


def _others(directory: str, step: int) -> list[tuple[str, Manifest]]:
    """The nearest other committed checkpoints under the same ROOT, with their manifests."""
    root = os.path.dirname(directory)
    near = sorted((abs(s - step), p) for s, p in rootdir.committed(root)
                  if os.path.abspath(p) != os.path.abspath(directory))
    out = []
    for _, path in near[:MAX_MANIFESTS]:
        try:
            if os.lstat(os.path.join(path, "MANIFEST.json")).st_size > MAX_MANIFEST_BYTES:
                continue
            text = read_bytes(path).decode("utf-8", errors="replace")
            out.append((path, Manifest.from_json(text, path, directory=path).load_all()))
        except (OSError, ManifestError):
            continue
    return out


def explain(rank: int, path: str, manifest: Manifest, directory: str) -> str:
    """``"; it is rank R's shard of ..."`` for rank ``rank``'s shard at ``path`` of the
    checkpoint ``directory`` described by ``manifest``, or ``""`` when it matches no other."""
    try:
        fd = rootdir.open_regular(path)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        if _matches(fd, size, manifest.ranks[rank], manifest.checksum_block):
            return ""
        for e in manifest.ranks:
            if e.rank != rank and _matches(fd, size, e, manifest.checksum_block):
                return (f"; it is rank {e.rank}'s shard of this checkpoint (size and checksums "
                        "match): the shards were swapped or copied between ranks")
        for other_dir, other in _others(directory, manifest.step):
            for e in other.ranks:
                if _matches(fd, size, e, other.checksum_block):
                    return (f"; it is rank {e.rank}'s shard of step {other.step} ({other_dir}; "
                            "size and "
                            f"checksums match), not of step {manifest.step}: it was copied here "
                            "from another checkpoint")
        return ""
    except OSError:
        return ""
    finally:
        os.close(fd)
