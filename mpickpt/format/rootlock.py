"""One job writes a ROOT at a time: rank 0 of a saving job holds an exclusive ``flock`` on
``ROOT/.mpickpt-writer`` from its first save until ``close()`` (or its death: the kernel lets
the lock go with the process).

Two jobs saving into one ROOT would remove each other's half-written steps at their starts and
replace each other's committed ones; processes whose launcher mpickpt does not know each think
they are rank 0 of a job of one. The second job's first save is therefore refused on every rank
(:class:`~mpickpt.errors.RootInUseError`, naming the holder), and a job that only restores never
takes the lock, nor removes what a live writer has half done.

Checkpointers of one process share its lock (a count), as they share its ROOT. A file system
without locks (Lustre mounted ``noflock``) is said once in the log, and saving goes on unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

NAME = ".mpickpt-writer"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

_LOCK = threading.Lock()
_HELD: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) of the lock file -> [fd, count]


def _open(root: str) -> int:
    """The lock file, made if missing; read-only where another user made it (a lock all the
    same, without the holder's note)."""
    path, flags = os.path.join(root, NAME), os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o664)
    except PermissionError:
        return os.open(path, os.O_RDONLY | flags)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def holder(root: str) -> str:
    """Who holds ROOT's lock, as its holder wrote it (host, pid, run, since), or ``"another
    process"`` where that cannot be read or names a process of this host that is gone."""
    try:
        with open(os.path.join(root, NAME), encoding="utf-8") as f:
            info = json.loads(f.read() or "{}")
        if info["host"] == socket.gethostname() and not _alive(int(info["pid"])):
            return "another process"  # the note of a holder that died; this one wrote none
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return (f"process {info['pid']} on {info['host']} (run {info['run']}, saving since "
                f"{since})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def take(root: str, run_id: str, logger: logging.Logger
         ) -> tuple[str | None, Callable[[], None]]:
    """Take ROOT's lock for this process (again, if it holds it already): (None, the call that
    lets this take go), or (who holds it, a call that does nothing). A ROOT that cannot be opened
    or locked is logged and given as free: saving then says why ROOT cannot be written, or goes
    on unguarded where the file system has no locks."""
    with _LOCK:
        try:
            fd = _open(root)
        except OSError as e:
            logger.debug("no writer lock in %s: %s", root, e)
            return None, _nothing
        key = _key(fd)
        if key in _HELD:
            os.close(fd)
            _HELD[key][1] += 1
            return None, _releaser(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _BUSY:
                return holder(root), _nothing
            logger.warning("cannot lock %s (%s): a second job saving into this ROOT at the same "
                           "time would not be refused", os.path.join(root, NAME),
                           e.strerror or e)
            return None, _nothing
        info = {"host": socket.gethostname(), "pid": os.getpid(), "run": run_id,
                "since": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as e:  # read-only: the refused job is told "another process"
            logger.debug("cannot note the holder in %s: %s", os.path.join(root, NAME), e)
        _HELD[key] = [fd, 1]
        return None, _releaser(key)


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
                with contextlib.suppress(OSError):  # (a read-only note stays; it is rewritten)
                    os.ftruncate(held[0], 0)  # no note naming a holder that let go
                os.close(held[0])  # closing the last descriptor of the lock lets it go

    return release


def free(root: str) -> bool:
    """Whether no process (this one included) holds ROOT's lock now: what a job's start asks
    before it removes the half-written steps of runs it takes for dead."""
    with _LOCK:
        try:
            fd = os.open(os.path.join(root, NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return True  # never locked (or unreadable: the removal then says why)
        try:
            if _key(fd) in _HELD:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                return e.errno not in _BUSY
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)
