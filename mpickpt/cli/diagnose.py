"""What the shards say when there is no manifest to go by, or when the same shards are missing
from every checkpoint.

* A partial directory (a save that never committed) has no manifest, so the size each shard should
  have is not known. What is known: which ranks' files are there, whether each one was sealed (a
  shard's writer writes its HDF5 metadata, superblock and end-of-file address included, last,
  before the vote; a shard laid out by HDF5 in its older format has a superblock marked open for
  writing until it is closed), and
  what the same rank wrote in the newest committed checkpoint of the same run. The number of
  ranks is that checkpoint's (else the newest checkpoint's, said as such); without one, a missing
  shard cannot be told from a rank that does not exist, and the note says so.
* A ROOT that was not one directory shared by every rank: rank 0 commits checkpoints whose
  manifest lists every rank, but only the shards written on rank 0's node are there, the same
  ranks missing from every checkpoint; on the other nodes the path holds only partial directories
  without rank 0's shard. :func:`not_shared` names it with
  :func:`mpickpt.format.rootdir.not_shared_hint`.

Reads sizes and the first bytes of each shard (its superblock), never the data, never h5py.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from ..format import rootdir
from ..format.manifest import Manifest, read_bytes
from ..format.names import RANK_FILE_RE, shard_name
from ..log import human_bytes
from ..ranks import ranks_text

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
MAX_MANIFESTS = 8  # committed manifests read to find the partial directory's run


def shard_state(path: str) -> str:
    """What is left of one shard: ``complete`` (its HDF5 header written, and the file as long as
    its superblock says), ``unsealed`` (no HDF5 header: mpickpt writes a shard's HDF5 metadata
    last, when it seals it, so its writer died before), ``unclosed`` (a version-2 superblock
    marked open for writing, as HDF5 itself leaves a file it was killed writing), ``short``
    (shorter than its recorded end: truncated since) or ``unreadable``."""
    try:
        fd = rootdir.open_regular(path)
    except OSError:
        return "unreadable"
    try:
        head, size = os.pread(fd, 64, 0), os.fstat(fd).st_size
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)
    if len(head) < 12 or head[:8] != HDF5_SIGNATURE:
        return "unsealed"
    version = head[8]
    if version in (0, 1):  # HDF5's earliest format, which mpickpt writes
        offset_size = head[13]
        # signature, versions, sizes, group Ks, flags (version 1: and 4 bytes more); then the
        # base, free-space and end-of-file addresses
        at = (24 if version == 0 else 28) + 2 * offset_size
        if offset_size not in (2, 4, 8) or len(head) < at + offset_size:
            return "complete"
        end = int.from_bytes(head[at:at + offset_size], "little")
        return "short" if size < end else "complete"
    offset_size, flags = head[9], head[11]
    if offset_size not in (2, 4, 8) or len(head) < 12 + 3 * offset_size:
        return "complete"  # nothing more to tell
    if flags & 1:
        return "unclosed"
    at = 12 + 2 * offset_size  # signature, versions, flags; base and extension addresses
    end = int.from_bytes(head[at:at + offset_size], "little")
    return "short" if size < end else "complete"


@dataclass
class PartialShards:
    """The shards of a partial directory, by rank."""

    world_size: int | None  # None: not known (no committed checkpoint to go by)
    basis: str | None  # where world_size comes from
    sizes: dict[int, int] = field(default_factory=dict)
    states: dict[int, str] = field(default_factory=dict)
    reference: dict[int, int] = field(default_factory=dict)  # rank -> bytes at reference_step
    reference_step: int | None = None

    def ranks(self, *states: str) -> list[int]:
        return sorted(r for r, s in self.states.items() if s in states)

    @property
    def missing(self) -> list[int]:
        """Ranks without a file; without the world size, those below the highest rank seen."""
        n = self.world_size if self.world_size is not None else max(self.states, default=-1) + 1
        return [r for r in range(n) if r not in self.states]

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "world_size_from": self.basis,
                "complete": self.ranks("complete"),
                "incomplete": self.ranks("unsealed", "unclosed", "short", "unreadable"),
                "missing": self.missing,
                "bytes": {str(r): n for r, n in sorted(self.sizes.items())}}

    def note(self) -> str:
        """The NOTE of the partial directory: which ranks' shards are incomplete or missing."""
        bad = self.ranks("unsealed", "unclosed", "short", "unreadable")
        done, missing = self.ranks("complete"), self.missing
        parts = ["a save that never committed"]
        if bad:
            parts.append(f"{_whose(bad)} incomplete ({self._why(bad)})")
        if missing:
            parts.append(f"{_whose(missing)} missing")
        if done:
            parts.append(f"{ranks_text(done)} wrote {'its' if len(done) == 1 else 'theirs'}")
        if done and not bad and not missing and self.world_size is not None:
            parts.append("every rank wrote its shard: the job died during the vote or the commit")
        if self.world_size is None:
            top = max(self.states, default=-1)
            parts.append("how many ranks the job had is not known (no committed checkpoint to "
                         "compare with)" + (f": shards of ranks above {top} cannot be named"
                                            if top >= 0 else ""))
        elif self.basis:
            parts.append(f"{self.world_size} ranks, as {self.basis}")
        return "; ".join(parts)

    def _why(self, ranks: list[int]) -> str:
        said = {"unsealed": "its writer never sealed it: no HDF5 header yet",
                "unclosed": "its writer never closed it", "short": "shorter than HDF5 recorded",
                "unreadable": "cannot be read"}
        out = []
        for r in ranks:
            text = f"{human_bytes(self.sizes.get(r))}, {said[self.states[r]]}"
            if r in self.reference:
                text += (f"; it wrote {human_bytes(self.reference[r])} at step "
                         f"{self.reference_step}")
            out.append(text if len(ranks) == 1 else f"rank {r}: {text}")
        return "; ".join(out)


def _whose(ranks: list[int]) -> str:
    """``"rank 2's shard is"``, ``"the shards of ranks 1,2 are"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}'s shard is"
    return f"the shards of {ranks_text(ranks)} are"


def _manifests(committed: list[str]) -> list[Manifest]:
    out = []
    for path in committed[:MAX_MANIFESTS]:
        try:
            out.append(Manifest.from_json(read_bytes(path).decode("utf-8", errors="replace"),
                                          path, directory=path).load_all())
        except ManifestError:
            continue
    return out


def partial_shards(path: str, run_id: str, committed: list[str]) -> PartialShards:
    """The shards of the partial directory ``path`` of run ``run_id``, compared with the
    committed checkpoints (directories, newest first)."""
    known = _manifests(committed)
    same = next((m for m in known if m.run_id == run_id), None)
    basis = None
    if same is not None:
        world: int | None = same.world_size
    elif known:
        world, basis = known[0].world_size, f"in the newest checkpoint (step {known[0].step})"
    else:
        world = None
    p = PartialShards(world, basis)
    if same is not None:
        p.reference = {r.rank: r.bytes for r in same.ranks}
        p.reference_step = same.step
    for f in _rank_files(path):
        m = RANK_FILE_RE.match(os.path.basename(f))
        if m:
            p.states[int(m.group(1))] = shard_state(f)
            with contextlib.suppress(OSError):
                p.sizes[int(m.group(1))] = os.lstat(f).st_size
    return p


def _rank_files(path: str) -> list[str]:
    """The files in checkpoint directory ``path`` and its ``shards-NNNN/`` sub-directories (a
    node's file cannot be told apart by rank: such saves are diagnosed from their manifests)."""
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False) and e.name.startswith("shards-"):
                    with contextlib.suppress(OSError):
                        out += [os.path.join(e.path, n) for n in os.listdir(e.path)]
                else:
                    out.append(e.path)
    except OSError:
        pass  # unreadable: no shards to diagnose by
    return out


def absent_ranks(path: str, m: Manifest) -> list[int]:
    """The ranks of ``m`` whose shard file is not in the checkpoint directory ``path``."""
    return [r.rank for r in m.ranks
            if r.file is not None and not os.path.lexists(os.path.join(path, r.file))]


def not_shared(committed: list[tuple[str, Manifest | None]],
               partial: list[str]) -> dict[str, Any] | None:
    """Whether ROOT looks like one rank's node-local copy, from its committed checkpoints
    (directory, manifest or None) and its partial directories: the finding, or None.

    Rank 0's side: every committed checkpoint whose manifest reads lacks the shards of the same
    ranks, and rank 0's is there. Another node's side: no committed checkpoint, and at least two
    partial directories, none with rank 0's shard."""
    readable = [(p, m) for p, m in committed if m is not None]
    if readable:
        sets = {tuple(absent_ranks(p, m)) for p, m in readable}
        if len(sets) != 1:
            return None
        missing = list(next(iter(sets)))
        world = max(m.world_size for _, m in readable)
        present = [r for r in range(world) if r not in missing]
        if not missing or 0 in missing:
            return None
        them = "rank 0's are" if present == [0] else f"those of {ranks_text(present)} are"
        n = len(readable)
        every = "the checkpoint" if n == 1 else f"every checkpoint ({n})"
        return {"missing_ranks": missing, "present_ranks": present, "message": (
            f"shards of {ranks_text(missing)} are missing from {every} while {them} present: "
            f"{rootdir.not_shared_hint()}. The missing shards may still be on the other nodes, "
            "in step-XXXXXXXX.partial-* directories under the same path")}
    if committed or len(partial) < 2:
        return None
    ranks = set()
    for path in partial:
        if not os.path.isdir(path):
            return None
        names = [os.path.basename(f) for f in _rank_files(path)]
        if shard_name(0) in names:
            return None
        ranks |= {int(m.group(1)) for n in names if (m := RANK_FILE_RE.match(n))}
    if not ranks:
        return None
    return {"missing_ranks": [0], "present_ranks": sorted(ranks), "message": (
        f"{len(partial)} saves never committed here, and none has rank 0's shard "
        f"({ranks_text(sorted(ranks))} wrote {'its' if len(ranks) == 1 else 'theirs'}): "
        f"{rootdir.not_shared_hint()}. These "
        "directories may hold the only copies of those ranks' shards of the checkpoints rank 0 "
        "committed on its node")}
