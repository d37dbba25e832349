"""Names and file-system steps of the on-disk layout under ROOT.

``step-XXXXXXXX/`` is committed (its MANIFEST.json is there); ``step-XXXXXXXX.partial-<run>/`` is
being written or was left by a crash and is never loaded; ``*.deleting-<run>`` is on its way out.
Every durable change is write-temp, fsync, rename, fsync the directory.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable

STEP_RE = re.compile(r"^step-(\d{8,})$")
PARTIAL_RE = re.compile(r"^step-(\d{8,})\.partial-([0-9a-z]+)$")
LEFTOVER_RE = re.compile(r"^step-(\d{8,})\.(deleting|replaced)-([0-9a-z]+)$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_name(step: int, run_id: str) -> str:
    return f"{step_name(step)}.partial-{run_id}"


def is_real_dir(path: str) -> bool:
    """A directory that is not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def committed(root: str, require_manifest: bool = True) -> list[tuple[int, str]]:
    """(step, directory) of every committed checkpoint, newest first.

    With ``require_manifest=False`` also the step directories whose manifest is missing, so that
    restore can report them."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and is_real_dir(path) and (
            not require_manifest or os.path.lexists(os.path.join(path, "MANIFEST.json"))
        ):
            out.append((int(m.group(1)), path))
    return sorted(out, reverse=True)


def leftovers(root: str, run_id: str) -> list[str]:
    """Partial directories of other runs and half-deleted checkpoints: safe to remove."""
    out = []
    for name in sorted(os.listdir(root)):
        m = PARTIAL_RE.match(name)
        if (m and m.group(2) != run_id) or LEFTOVER_RE.match(name):
            out.append(os.path.join(root, name))
    return out


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory, so that its entries are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, on_half: Callable[[], None] | None = None) -> None:
    """Durably replace ``path`` with ``data``: temp file, fsync, rename, fsync the directory.

    ``on_half`` runs after half the bytes reached the temp file (a fault injection point).
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        half = len(data) // 2
        os.write(fd, data[:half])
        if on_half is not None:
            on_half()
        view = memoryview(data)[half:]
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def remove(path: str, run_id: str) -> None:
    """Remove a checkpoint directory so that no crash leaves it looking committed: rename it to
    ``*.deleting-<run>`` (fsync'd), then delete the files."""
    parent, name = os.path.split(path)
    base = name.split(".", 1)[0]
    doomed = os.path.join(parent, f"{base}.deleting-{run_id}")
    if os.path.lexists(doomed):
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    fsync_path(parent)
    shutil.rmtree(doomed)
