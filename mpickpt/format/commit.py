"""The commit, in one place: how a checkpoint comes to exist, wherever it is published.

A checkpoint is written into ``step-XXXXXXXX.partial-<run>/`` and exists once that directory is
renamed ``step-XXXXXXXX/`` with its ``MANIFEST.json`` inside. :func:`publish` is that commit:
the side files, then the manifest (each written atomically: a temporary file, fsync, rename),
then the rename of the directory into place and an fsync of its parent, so the new entry is
durable. :func:`presence` is the check that comes before it: every rank's shard is in the
partial directory as this process sees it, at the size its rank wrote (a rank that wrote no
tensor has no shard). The save pipeline
(ROOT), the node-local level's commit on every node and the drain (``mpickpt drain``) all
commit through here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from . import rootdir
from .entry import RankEntry
from .manifest import NAME as MANIFEST


@dataclass(frozen=True)
class Presence:
    """What :func:`presence` found: the ranks whose shard is missing, and those whose shard is
    there at another size than its rank wrote."""

    missing: list[int]
    wrong_size: list[int]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.wrong_size


def presence(partial: str, ranks: Iterable[RankEntry]) -> Presence:
    """Every rank's shard in ``partial``, as this process sees it, at its size? The entries of
    its sub-directories (``shards-NNNN/``) are made durable on the way: the manifest's commit
    syncs only the top."""
    sizes: dict[str, int] = {}
    for top, dirs, files in os.walk(partial):
        rel = os.path.relpath(top, partial)
        for name in files:
            st = os.lstat(os.path.join(top, name))
            if stat.S_ISREG(st.st_mode):
                sizes[name if rel == "." else f"{rel}/{name}"] = st.st_size
        for d in dirs:
            rootdir.fsync_path(os.path.join(top, d))
    entries = [e for e in ranks if e.file is not None]  # (a rank without a file: nothing to see)
    missing = [e.rank for e in entries if e.file not in sizes]
    wrong = [e.rank for e in entries if e.file in sizes and sizes[e.file] != e.bytes]
    return Presence(missing, wrong)


def publish(parent: str, partial: str, step: int, manifest: bytes, *,
            side: Sequence[tuple[str, bytes]] = (),
            existing: Callable[[str], None],
            on_half: Callable[[], None] | None = None) -> str:
    """Commit ``partial`` as step ``step`` of ``parent``: write the ``side`` files (name, bytes)
    and then the manifest into it, rename it into place and sync ``parent``; the committed
    path. A step already committed there is first handed to ``existing``, which removes it (the
    step saved again) or raises (nothing is committed). ``on_half`` runs when half of the
    manifest is written (a fault injection point)."""
    for name, data in side:
        rootdir.atomic_write(os.path.join(partial, name), data)
    rootdir.atomic_write(os.path.join(partial, MANIFEST), manifest, on_half=on_half)
    final = os.path.join(parent, rootdir.step_name(step))
    if os.path.lexists(final):
        existing(final)
    os.rename(partial, final)
    rootdir.fsync_path(parent)
    return final
