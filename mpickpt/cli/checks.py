"""Verifying one checkpoint, with the same rules and the same sentences as restore.

quick: the manifest parses and validates (strict JSON, its own checksum), every rank's shard opens
(no symbolic link), has exactly the size the manifest records, and every tensor record fits in it
(:func:`mpickpt.format.records.check_records`). Reads a few hundred bytes per shard.

full: quick, then every block of every tensor is read and its xxh3-64 compared with the manifest's
(the check restore makes before it touches the state, by the same reader:
:meth:`mpickpt.format.blocks.BlockFile.read_block`). Blocks are read by a few threads in pieces of
at most :data:`CHUNK` bytes into reused buffers, so memory stays at ``threads`` pieces whatever the
manifest says the block size is. Every shard and every block is checked (no early stop), so
the verdict is the same whichever process checks which shard, and the first problem reported is
the one of the lowest rank, tensor and block. Then the shard's HDF5 metadata is read and compared
with the manifest (:mod:`.h5meta`): restore does not need it, h5py and h5dump do.

A shard that fails because it is another rank's, or another checkpoint's, is named as such
(:func:`mpickpt.restore.provenance.explain`, the sentence restore logs).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import ShardError
from ..format import checksum, rootdir
from ..format.blocks import BlockFile
from ..format.entry import RankEntry
from ..format.manifest import Manifest
from ..format.records import TensorRecord, check_file, check_records
from ..restore import provenance
from . import EXIT_ERROR, EXIT_NO_CHECKPOINT
from .catalog import (
    MANIFEST,
    QUARANTINE,
    Entry,
    ManifestUnreadable,
    Problem,
    locate,
    read_manifest,
    root_problem,
    scan,
    set_from_manifest,
    step_of,
)


def shard_path(checkpoint: str, entry: RankEntry) -> str:
    return os.path.join(checkpoint, entry.file)


CHUNK = 8 << 20  # the most one reader thread holds


def _problem(e: ShardError, m: Manifest | None = None, checkpoint: str | None = None) -> Problem:
    """The problem, with where the shard came from when it is another's (given the manifest)."""
    why = str(e)
    if denied(e.path):
        return Problem(why, e.rank, e.path, denied=True)
    if m is not None and checkpoint is not None:
        why += provenance.explain(e.rank, e.path, m, checkpoint)
    return Problem(why, e.rank, e.path)


def _check_shard(checkpoint: str, m: Manifest, r: RankEntry) -> None:
    """Check the shard as restore does: a regular file (no link, no FIFO) of the recorded size,
    and every record fits it; so too the older shards an incremental checkpoint refers to."""
    for f in r.files(checkpoint):
        check_file(r.rank, f.path, f.bytes)
        check_records(r.rank, f.path, f.records, f.bytes, m.checksum_block)


def denied(path: str) -> bool:
    """Whether this user may not read ``path`` or search its directory: a check that fails so
    says nothing of the bytes (the job's user may read them)."""
    return not os.access(os.path.dirname(path) or ".", os.X_OK) or (
        os.path.lexists(path) and not os.access(path, os.R_OK))


def quick(entry: Entry) -> None:
    """Check a committed checkpoint's manifest and shard sizes; mark it corrupt (unreadable,
    misnamed, ...: :meth:`Entry.fail`) or 'quick'."""
    mpath = os.path.join(entry.path, MANIFEST)
    try:
        m = read_manifest(entry.path)
    except ManifestUnreadable as e:
        entry.fail([Problem(str(e), file=mpath, unsupported=e.unsupported,
                            denied=denied(mpath))])
        return
    entry.manifest = m
    set_from_manifest(entry, m)
    problems = []
    if entry.step is not None and m.step != entry.step:  # as restore refuses it
        problems.append(Problem(
            f"{mpath} is the manifest of step {m.step}, not of step {entry.step}: it was "
            "copied or moved here, and restore refuses it (named "
            f"{rootdir.step_name(m.step)}, it would load)", file=mpath, misnamed=True))
    for r in m.ranks:
        try:
            _check_shard(entry.path, m, r)
        except ShardError as e:
            problems.append(_problem(e, m, entry.path))
    if problems:
        entry.fail(problems)
    else:
        entry.verified = "quick"


def verify_shard(checkpoint: str, m: Manifest, rank: int, threads: int = 4,
                 on_bytes: Callable[[int], None] | None = None) -> Problem | None:
    """Read every block of rank ``rank``'s shard (and of the older shards its incremental
    records refer to) and compare its checksum, then the shard's HDF5 metadata; the first
    problem."""
    entry = m.ranks[rank]
    if entry.file is None:  # it wrote no tensor: nothing of its own to read
        return None
    path = shard_path(checkpoint, entry)
    try:
        _check_shard(checkpoint, m, entry)
    except ShardError as e:
        return _problem(e, m, checkpoint)
    for i, f in enumerate(entry.files(checkpoint)):
        try:
            bf = BlockFile(rank, f.path, f.bytes, m.checksum_block)
        except ShardError as e:
            return _problem(e, m, checkpoint)
        except OSError as e:
            return _problem(ShardError(rank, f.path, f"cannot open: {e.strerror}"))
        with bf:
            errors = _read_blocks(bf, f.records, threads, on_bytes)
            if errors:
                first = _problem(errors[0], m, checkpoint)
                if len(errors) > 1:
                    first.reason += f"; {len(errors) - 1} more damaged block(s) in this shard"
                return first
            if i == 0:  # this checkpoint's own shard: its HDF5 metadata too
                from . import h5meta  # h5py: only full verification needs it

                why = h5meta.problem(bf.fd, m, entry)
                if why is not None:
                    return Problem(f"rank {rank}: {path}: {why}", rank, path, restorable=True)
    return None


def _read_blocks(f: BlockFile, records: list[TensorRecord], threads: int,
                 on_bytes: Callable[[int], None] | None) -> list[ShardError]:
    """Read and check every block of these records of an open shard; every problem, in order."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    tasks = [(r, b) for r in records for b in range(checksum.block_count(r.nbytes, f.block))]
    local = threading.local()

    def check(r: TensorRecord, b: int) -> ShardError | None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(CHUNK))
        try:
            n = f.read_block(r, b, buf)
        except ShardError as e:
            return e
        if on_bytes is not None:
            on_bytes(n)
        return None

    with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="mpickpt-verify") as pool:
        return [e for e in pool.map(lambda t: check(*t), tasks) if e is not None]


class Unusable(Exception):
    """The checkpoint asked for cannot be had; ``code`` is the exit code to end with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def pick(path: str, step: int | None) -> Entry:
    """The checkpoint a command line names, quick-checked (it may come back corrupt).

    ``ROOT/step-XXXXXXXX`` (or a quarantined or partial directory) names one; ``ROOT`` with
    ``step`` names ``ROOT/step-{step}``; ``ROOT`` alone names the newest that passes the quick
    check (the one restore would load)."""
    root, one = locate(path)
    if one is not None:
        if not os.path.isdir(one):
            raise Unusable(f"{one}: no such directory", EXIT_ERROR)
        e = Entry(os.path.basename(one), one, "committed", step_of(os.path.basename(one)))
        if step is not None and e.step != step:
            raise Unusable(f"{one} is step {e.step}, not step {step}", EXIT_ERROR)
        quick(e)
        if e.status == "committed" and os.path.basename(os.path.dirname(one)) == QUARANTINE:
            e.status = "quarantined"  # intact, but moved aside: restore will not load it
        return e
    why = root_problem(root)
    if why is not None:
        raise Unusable(why, EXIT_ERROR)
    committed = [e for e in scan(root) if e.status == "committed"]
    if step is not None:
        for e in committed:
            if e.step == step:
                quick(e)
                return e
        steps = ", ".join(str(e.step) for e in committed) or "none"
        raise Unusable(f"no committed checkpoint of step {step} under {root} (committed: "
                       f"{steps}; a quarantined one is named by its path, "
                       f"{root}/quarantine/NAME)", EXIT_ERROR)
    for e in committed:
        quick(e)
        if e.status == "committed":
            return e
    raise Unusable(f"no checkpoint under {root} passes verification "
                   f"(`mpickpt-restore {root} --list` says why)", EXIT_NO_CHECKPOINT)
