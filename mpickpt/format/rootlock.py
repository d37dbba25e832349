"""One job saves into a ROOT at a time: rank 0 of a saving job holds an exclusive ``flock`` on
the directory ROOT from its first save until ``close()`` (or its death: the kernel lets the lock
go with the process). Nothing is written for it: a lock on the directory itself.

Two jobs saving into one ROOT would remove each other's half-written steps at their starts and
replace each other's committed ones; processes whose launcher mpickpt does not know each think
they are rank 0 of a job of one. The second job's first save is therefore refused on every rank
(:class:`~mpickpt.errors.RootInUseError`, naming the holder where this host can see it), and a
job that only restores never takes the lock, nor removes what a live writer has half done.

Checkpointers of one process share its lock (a count), as they share its ROOT. A file system
that cannot lock a directory (NFS) is locked through a file, ``ROOT/.mpickpt-writer``, instead;
one that cannot lock at all (Lustre mounted ``noflock``) is said in the log, and saving
goes on unguarded. One that keeps its locks per host (:func:`mounts.per_host_locks`) guards
against a second job on this host only; the log says that too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable

from . import mounts

NAME = ".mpickpt-writer"  # the lock file, where a directory cannot be locked
ELSEWHERE = "a process on another host (or one this host cannot see)"  # no holder seen here
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

_LOCK = threading.Lock()
_HELD: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) of what is locked -> [fd, count]
TRIES, TRY_GAP_S = 5, 0.2  # a lock found held is asked again: free() holds one for a moment


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) holds no lock of its parent's: it closes its copies
    of the descriptors (unlocking nothing: the parent's stay) so that the lock goes with the
    parent, not with the last child."""
    global _LOCK
    _LOCK = threading.Lock()
    for fd, _ in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _locked(fd: int, how: int = fcntl.LOCK_EX) -> bool | None:
    """Lock ``fd``: True, False where another holds it, None where it cannot be locked."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as e:
        return False if e.errno in _BUSY else None
    return True


def holder(key: tuple[int, int]) -> str:
    """Who holds the lock on ``key``, as this host's ``/proc/locks`` shows it: "process P
    (command) on this host", or "a process on another host" where no process here holds it."""
    dev = f"{os.major(key[0]):02x}:{os.minor(key[0]):02x}:{key[1]}"
    try:
        with open("/proc/locks", encoding="ascii") as f:
            pids = [int(p[4]) for p in (line.split() for line in f)
                    if len(p) > 5 and p[1] == "FLOCK" and p[5] == dev]
    except (OSError, ValueError):
        pids = []
    for pid in (p for p in pids if p > 0):  # 0: another PID namespace's, or one gone
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            cmd = "?"
        return f"process {pid} ({cmd}) on this host"
    return ELSEWHERE


def who(root: str) -> str:
    """Who holds ROOT's lock (:func:`holder`), on the directory or on its lock file."""
    found = ELSEWHERE
    for path in (root, os.path.join(root, NAME)):
        try:
            st = os.stat(path)
        except OSError:
            continue
        found = holder((st.st_dev, st.st_ino))
        if found != ELSEWHERE:
            break
    return found


def take(root: str, logger: logging.Logger) -> tuple[str | None, Callable[[], None]]:
    """Take ROOT's lock for this process (again, if it holds it already): (None, the call that
    lets this take go), or (who holds it, a call that does nothing), asked :data:`TRIES` times
    first. A ROOT that cannot be opened is given as free (saving then says why it cannot be
    written)."""
    for _ in range(TRIES - 1):
        busy, release = _take_once(root, logger)
        if busy is None:
            return busy, release
        time.sleep(TRY_GAP_S)
    return _take_once(root, logger)


def _take_once(root: str, logger: logging.Logger) -> tuple[str | None, Callable[[], None]]:
    with _LOCK:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            logger.debug("no writer lock on %s: %s", root, e)
            return None, _nothing
        key = _key(fd)
        got = _take(fd, key)
        if got is None:  # the directory cannot be locked here: a file in it instead
            os.close(fd)
            try:
                fd = os.open(os.path.join(root, NAME),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
            except OSError as e:
                return _unguarded(root, e, logger)
            key = _key(fd)
            got = _take(fd, key)
            if got is None:
                os.close(fd)
                return _unguarded(root, OSError("the file system has no locks"), logger)
        if got is not True:
            return got, _nothing
        if _HELD[key][1] == 1 and (how := mounts.per_host_locks(root)) is not None:
            logger.warning("ROOT %s is on %s, whose locks are kept per host: its writer lock "
                           "refuses a second job saving into it only on this host, not on "
                           "another", root, how)
        return None, _releaser(key)


def _take(fd: int, key: tuple[int, int]) -> str | bool | None:
    """True once ``fd``'s lock (``key``) is this process's (it keeps ``fd``, or counts one
    more take); who holds it (``fd`` closed); None where it cannot be locked."""
    if key in _HELD:
        os.close(fd)
        _HELD[key][1] += 1
        return True
    got = _locked(fd)
    if got is None:
        return None
    if not got:
        os.close(fd)
        return holder(key)
    _HELD[key] = [fd, 1]
    return True


def _unguarded(root: str, e: OSError, logger: logging.Logger
               ) -> tuple[None, Callable[[], None]]:
    logger.warning("cannot lock %s (%s): a second job saving into this ROOT at the same time "
                   "would not be refused", root, e.strerror or e)
    return None, _nothing


def _nothing() -> None:
    pass


def _releaser(key: tuple[int, int]) -> Callable[[], None]:
    """The call that lets go of one :func:`take` by this process (the last one unlocks); a
    second call of it does nothing."""
    done = [False]

    def release() -> None:
        with _LOCK:
            held = _HELD.get(key)
            if done[0] or held is None:
                return
            done[0] = True
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                try:  # unlocked, not only closed: a forked child may share the descriptor
                    fcntl.flock(held[0], fcntl.LOCK_UN)
                finally:
                    os.close(held[0])

    return release


def free(root: str) -> bool:
    """Whether no process (this one included) holds ROOT's lock now: what a job's start asks
    before it removes the half-written steps of runs it takes for dead. ROOT may be a symbolic
    link (the lock is on the directory it names); the lock file is opened for writing where it
    can be (NFS locks only such files)."""
    with _LOCK:
        for path, flags in ((root, os.O_RDONLY | os.O_DIRECTORY), (os.path.join(root, NAME),
                                                                  os.O_RDWR | os.O_NOFOLLOW)):
            try:
                fd = os.open(path, flags | os.O_CLOEXEC)
            except PermissionError:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
            except OSError:
                continue  # no lock file (or an unreadable ROOT: the removal then says why)
            try:
                if _key(fd) in _HELD:
                    return False
                got = _locked(fd, fcntl.LOCK_SH)
                if got is False:
                    return False
                if got:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return True
