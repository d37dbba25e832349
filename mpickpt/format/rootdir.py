"""Names and file-system steps of the on-disk layout under ROOT.

``step-XXXXXXXX/`` is committed (its MANIFEST.json is there); ``step-XXXXXXXX.partial-<run>/`` is
being written or was left by a crash and is never loaded; ``*.deleting-<run>`` is on its way out;
``.pool/`` holds the shard files of the checkpoint retention retired last, which the next save
writes over (:func:`retire`, :func:`take`).
Every durable change is write-temp, fsync, rename, fsync the directory.

Files are created with mode :data:`FILE_MODE` and directories with :data:`DIR_MODE`: the umask
applies, and nothing is ever world-writable, even under ``umask 000``. ROOT is the team's: its
group and others may read what the umask lets them. Under a *private* tree (the node-local
level's directory, :func:`make_private`), files are 0600 and directories 0700 whatever the umask:
that copy of the state is the job's user's alone (:func:`file_mode`, :func:`dir_mode`). Files of
a checkpoint are read through :func:`open_regular`: never through a symbolic link, never a FIFO
or a device.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import time
from collections.abc import Callable

STEP_RE = re.compile(r"^step-(\d{8,})$")
PARTIAL_RE = re.compile(r"^step-(\d{8,})\.partial-([0-9a-z]+)$")
LEFTOVER_RE = re.compile(r"^step-(\d{8,})\.(deleting|replaced)-([0-9a-z]+)$")
POOL = ".pool"  # under ROOT: retired shard files, for the next save to write over
SIGNATURE_BYTES = 8  # HDF5's signature at the start of a shard, wiped when it is recycled
FILE_MODE = 0o664  # 0o666 less world-write; the umask takes away more
DIR_MODE = 0o775
PRIVATE_FILE_MODE = 0o600  # under a private tree: the job's user only
PRIVATE_DIR_MODE = 0o700
_PRIVATE: set[str] = set()  # the private trees of this process (absolute paths)


def _private(path: str) -> bool:
    path = os.path.abspath(path)
    return any(path == p or path.startswith(p + os.sep) for p in _PRIVATE)


def file_mode(path: str) -> int:
    """The mode to create ``path`` with: 0600 under a private tree, else :data:`FILE_MODE`."""
    return PRIVATE_FILE_MODE if _private(path) else FILE_MODE


def dir_mode(path: str) -> int:
    """The mode to create directory ``path`` with: 0700 under a private tree, else
    :data:`DIR_MODE`."""
    return PRIVATE_DIR_MODE if _private(path) else DIR_MODE


def mark_private(path: str) -> str:
    """Files and directories made under ``path`` from now on are 0600 and 0700 (on every rank
    that writes there; :func:`make_private` also makes the directory safe). Its absolute path."""
    path = os.path.abspath(path)
    _PRIVATE.add(path)
    return path


class UnsafeDirectoryError(PermissionError):
    """A directory of a private tree is not the job user's own: a link, or another user's."""


def make_private(path: str) -> None:
    """Make ``path`` a private tree: every missing directory up to it created 0700, and it (and
    each existing directory between it and the first one that others may write to, such as
    ``/dev/shm`` or ``/tmp``) refused unless it is a real directory of this user; one of this
    user's with wider permissions is narrowed to 0700. Files and directories made under it
    later are 0600 and 0700 (:func:`file_mode`, :func:`dir_mode`).

    :class:`UnsafeDirectoryError` names the directory planted by another user (or a symbolic
    link put where it should be): another user of the node could read the state, or have the
    job write where they choose."""
    path = mark_private(path)
    missing, at = [], path
    while not os.path.lexists(at):
        missing.append(at)
        at = os.path.dirname(at)
    chain, up, shared = [], at, False  # the existing directories, up to a shared one
    while True:
        st = os.lstat(up)
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_mode & 0o002:
            shared = True  # /tmp, /dev/shm: every user may create here; ours must be ours
            break
        chain.append((up, st))
        if up == os.path.dirname(up):
            break
        up = os.path.dirname(up)
    for where, st in chain if shared else [c for c in chain if c[0] == path]:
        _check_own(where, st)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, PRIVATE_DIR_MODE)
        _check_own(d, os.lstat(d))
    if os.lstat(path).st_mode & 0o077:
        os.chmod(path, PRIVATE_DIR_MODE)


def _check_own(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectoryError(
            errno.EPERM, f"is a symbolic link (to {os.readlink(path)}), not a directory: "
            "someone else may have put it there. Remove it, or give the level another "
            "directory", path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(errno.ENOTDIR, "is not a directory", path)
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            errno.EPERM, f"belongs to user {st.st_uid}, not to this job's user "
            f"{os.geteuid()}: another user may have created it to read the job's state. "
            "Give the level a directory of its own (e.g. with the job id in its name), or "
            "remove that one", path)


# what to do when ranks do not share ROOT, as a save refuses it (not_shared_hint: as the tools
# and restore, which can only suspect it, say it)
NOT_SHARED_ADVICE = (
    "every rank's shard must land in the same directory for a checkpoint to commit: give every "
    "rank the same path on a filesystem that all nodes mount (/scratch, $HOME, ...), not "
    "node-local storage such as /tmp, /dev/shm or $TMPDIR")


def not_shared_hint() -> str:
    """The advice for a ROOT that was not one directory shared by every rank (each rank then
    wrote into its own node's copy): the same words wherever mpickpt finds that."""
    return ("ROOT was probably not one directory shared by every rank (node-local storage such "
            "as /tmp or $TMPDIR); give every rank the same path on a shared filesystem")


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


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, every directory it creates with :func:`dir_mode`."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        make_dirs(parent)
    try:
        os.mkdir(path, dir_mode(path))
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``: never through a symbolic link, and a
    FIFO or device is refused rather than waited on. OSError with a readable strerror otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "it is a symbolic link, and checkpoint files are never read "
                          "through one", path) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
        raise OSError(errno.EINVAL, f"it is {kind}, not a regular file", path)
    return fd


def committed(root: str, require_manifest: bool = True) -> list[tuple[int, str]]:
    """(step, directory) of every committed checkpoint, newest first.

    With ``require_manifest=False`` also the step directories whose manifest is missing, and
    ``step-XXXXXXXX`` entries that are symbolic links, so that restore can report (and refuse)
    them."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = STEP_RE.match(name)
        path = os.path.join(root, name)
        if not m:
            continue
        if is_real_dir(path):
            if not require_manifest or os.path.lexists(os.path.join(path, "MANIFEST.json")):
                out.append((int(m.group(1)), path))
        elif not require_manifest and os.path.islink(path):
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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, file_mode(path))
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
    ``*.deleting-<run>`` (fsync'd), then delete the files. A symbolic link is unlinked, never
    followed."""
    doomed = _set_aside(path, run_id)
    if doomed is not None:
        shutil.rmtree(doomed)


def _set_aside(path: str, run_id: str) -> str | None:
    """The first step of :func:`remove`: the checkpoint directory renamed to
    ``*.deleting-<run>`` (fsync'd), which it returns; a symbolic link is unlinked (None)."""
    parent, name = os.path.split(path)
    if os.path.islink(path):
        os.unlink(path)
        fsync_path(parent)
        return None
    doomed = os.path.join(parent, f"{name.split('.', 1)[0]}.deleting-{run_id}")
    if os.path.lexists(doomed):
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    fsync_path(parent)
    return doomed


def retire(path: str, run_id: str, pool: str, keep: Callable[[str], bool]) -> None:
    """Remove a checkpoint directory as :func:`remove` does, but first move the files that
    ``keep`` accepts (by their path relative to the checkpoint) into ``pool`` under the same
    relative path, for the next save to write over instead of allocating fresh blocks: freeing
    a large file's blocks takes about a second per GB on ext4, and writing over allocated blocks
    is faster than into new ones. What the pool held under other names is deleted, so that it
    never holds more than one checkpoint's files."""
    doomed = _set_aside(path, run_id)
    if doomed is None:
        return
    kept = set()
    for rel in _files(doomed):
        if keep(rel):
            make_dirs(os.path.dirname(os.path.join(pool, rel)))
            os.replace(os.path.join(doomed, rel), os.path.join(pool, rel))
            kept.add(rel)
    for rel in _files(pool):
        if rel not in kept:
            with contextlib.suppress(FileNotFoundError):  # a rank took it meanwhile
                os.unlink(os.path.join(pool, rel))
    shutil.rmtree(doomed)


def _files(top: str) -> list[str]:
    """The paths of the files under ``top``, relative to it (by slicing: ``os.path.relpath``
    normalizes both paths each time, and listing a retired step and the pool took 0.058 ms of
    a retirement's 0.23 ms with it, 0.025 ms without)."""
    n = len(os.path.join(top, ""))
    return [os.path.join(d[n:], f) for d, _, fs in os.walk(top) for f in fs]


def pooled(root: str) -> tuple[int, int]:
    """What ``ROOT/.pool`` holds: (files, bytes allocated); (0, 0) without one."""
    files = allocated = 0
    for dirpath, _, names in os.walk(os.path.join(root, POOL)):
        for f in names:
            with contextlib.suppress(FileNotFoundError):  # a save took it meanwhile
                allocated += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                files += 1
    return files, allocated


def take(pool: str, name: str, dest: str) -> bool:
    """Move the pooled file ``name`` (relative to ``pool``) to ``dest``, if the pool has it as a
    regular file of this user with no other link (writing over a file that a hard link shares
    would change the other name's bytes), of the mode a new file ``dest`` would get under the
    umask now; whether it did. Its HDF5 signature is wiped at once: a shard's header is written
    last, so a writer killed before it leaves a file that says so, as a new one would
    (``mpickpt.cli.diagnose.shard_state``), not the retired checkpoint's sealed shard."""
    src = os.path.join(pool, name)
    try:
        st = os.lstat(src)
    except (FileNotFoundError, NotADirectoryError):
        return False
    mask = umask()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 \
            or mask is None or stat.S_IMODE(st.st_mode) != file_mode(dest) & ~mask:
        return False
    try:
        os.rename(src, dest)
    except FileNotFoundError:  # rank 0's retention deleted it meanwhile
        return False
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.pwrite(fd, bytes(SIGNATURE_BYTES), 0)
        finally:
            os.close(fd)
    except OSError:  # it cannot be written over: a new file instead
        os.unlink(dest)
        return False
    return True


def umask() -> int | None:
    """This process's umask, read without changing it (Linux's /proc, in one ``os.read``: half
    the time of a text file's read, at every recycled shard); None where unknown."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return parse_umask(os.read(fd, 1 << 16))
        finally:
            os.close(fd)
    except OSError:  # no /proc
        return None


def parse_umask(status: bytes) -> int | None:
    """The umask in ``/proc/<pid>/status``'s line ``Umask:\t0022``; None if none reads so."""
    at = status.find(b"\nUmask:")
    end = status.find(b"\n", at + 7)
    try:
        return int(status[at + 7:end if end >= 0 else None], 8) if at >= 0 else None
    except ValueError:
        return None


COPY_CHUNK = 8 << 20


def copy_file(src: str, dst: str, on_bytes: Callable[[int], None] | None = None,
              bandwidth: float | None = None, over: bool = False) -> int:
    """Copy ``src`` (a regular file, never through a link) to ``dst`` (created, never through
    a link; ``over``: written over where it is, a recycled file, :func:`take`) and fsync it, in
    chunks (a kernel copy where it can), at most ``bandwidth`` bytes per second; ``on_bytes``
    after each chunk. The bytes copied."""
    fin = open_regular(src)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | (0 if over else os.O_TRUNC)
                       | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode(dst))
        try:
            size, done, t0 = os.fstat(fin).st_size, 0, time.monotonic()
            # over a recycled file, its first piece (a shard's HDF5 header) goes last: a copy
            # cut short leaves no header, as a new file's would be short
            starts = [*range(COPY_CHUNK, size, COPY_CHUNK), 0] if over else \
                list(range(0, size, COPY_CHUNK))
            for start in starts:
                at, end = start, min(start + COPY_CHUNK, size)
                while at < end:
                    got = _copy_range(fin, fout, at, end - at, src, size)
                    at += got
                done += end - start
                if on_bytes is not None:
                    on_bytes(end - start)
                if bandwidth:
                    ahead = done / bandwidth - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            if over:
                os.ftruncate(fout, size)
            os.fsync(fout)
            return done
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _copy_range(fin: int, fout: int, at: int, n: int, src: str, size: int) -> int:
    """Copy up to ``n`` bytes at offset ``at`` (a kernel copy where it can); how many."""
    try:
        got = os.copy_file_range(fin, fout, n, at, at)
    except OSError:
        got = 0
    if got <= 0:
        data = os.pread(fin, n, at)
        if not data:
            raise OSError(errno.EIO, f"{src} ended at byte {at} of {size}")
        got = os.pwrite(fout, data, at)
    return got


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def in_memory(path: str) -> bool:
    """Whether ``path`` lies on a file system held in memory (``/dev/shm``'s tmpfs): a file there
    can be used where it lies, mapped, at the cost of a memory copy (Linux's mount table; False
    where it cannot be read)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, fstype = -1, ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fstype = len(point), fields[2]
    return fstype in MEMORY_FILESYSTEMS
