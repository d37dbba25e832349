"""The I/O threads that write and read shards: started once per process, reused by every save
and restore, the writers at a lower CPU priority than training."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..background import lower_priority


def run_tasks(tasks: list[tuple[int, int]], fn: Callable[[int, int], None], threads: int,
              background: bool = False) -> None:
    """Run ``fn(*task)`` for every task on ``threads`` threads; the first error cancels the rest.
    ``background`` threads run at a lower CPU priority."""
    start_tasks(tasks, fn, threads if len(tasks) > 1 else 1, background).wait()


class Batch:
    """Tasks started on the I/O threads (:func:`start_tasks`)."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self.futures = futures

    def wait(self) -> None:
        """Until every task is done; the first error raised, the tasks not started cancelled."""
        try:
            for fut in self.futures:
                fut.result()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Cancel the tasks not started and wait for the running ones (they use the caller's
        buffers and descriptors); their errors are dropped: the caller is failing already."""
        for fut in self.futures:
            fut.cancel()
        wait(self.futures)


def start_tasks(tasks: list[tuple[int, int]], fn: Callable[[int, int], None], threads: int,
                background: bool = False) -> Batch:
    """:func:`run_tasks` without waiting: the tasks started, to be waited for with
    :meth:`Batch.wait`. With one thread they run here and now."""
    if threads <= 1:
        for t in tasks:
            fn(*t)
        return Batch([])
    return Batch([pool(threads, background).submit(fn, *t) for t in tasks])


def beside(meanwhile: Callable[[], None], work: Callable[[], object]) -> None:
    """``work()`` on this thread while ``meanwhile()`` runs on a thread of its own, at this
    process's priority; returns once both are done. ``meanwhile`` fills what ``work`` reads:
    it is waited for however ``work`` ends, and its error, the first cause, is raised before
    ``work``'s."""
    fut = pool(1, False, "beside").submit(meanwhile)
    try:
        work()
    except BaseException as e:
        first = fut.exception()  # waits for it
        if first is not None:
            raise first from e
        raise
    fut.result()


def prestart(executor: ThreadPoolExecutor, threads: int) -> None:
    """Make sure ``executor`` has ``threads`` threads (at most its size) before they are
    needed. An executor makes a thread when a task finds none idle, and making one maps its
    stack, which waits behind the process's page faults and page-locking: while a restore's
    reads page-locked their buffers, the first XOR of a rebuild on an H200 host waited
    0.1-0.2 s for its threads, and the whole ring with it."""
    meet = threading.Barrier(threads)
    for f in [executor.submit(meet.wait, 10) for _ in range(threads)]:
        f.result()


_POOLS: dict[tuple[str, int, bool], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOLS.clear)  # a child has none of the threads


def pool(threads: int, background: bool, name: str = "io") -> ThreadPoolExecutor:
    """The threads of one use (``name``: the I/O threads, or another pool apart from theirs,
    such as the XOR's), size and priority, started once and reused by every save and restore:
    MPICH keeps a few hundred bytes of every thread started after MPI_Init, so new threads per
    save made the soak test's memory grow by 1 MB per 1000 saves."""
    with _POOLS_LOCK:
        pool = _POOLS.get((name, threads, background))
        if pool is None:
            init = lower_priority if background else None
            pool = _POOLS[name, threads, background] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"mpickpt-{name}", initializer=init)
        return pool
