"""How a rank waits for a non-blocking collective: it tests it, then naps between tests.

Each test drives MPI's progress and burns CPU: with 200 tests and 0.5 ms naps, a tiny checkpoint
saved every step slowed 4-rank DDP on 2 cores by 39%, with :data:`POLL_SPINS` tests and naps
from :data:`POLL_NAP_S` doubling up to :data:`POLL_NAP_MAX_S` by 12-20%
(``bench/bench_frequent.py``): a save's collectives wait that way. A restore's wait briskly
(``Protocol.brisk``: naps of at most :data:`BRISK_NAP_S`): a two-stage object collective took
1 ms on the 2-core VM against 6 with naps up to 2 ms, in which each rank napped through the
other's stage, for the same CPU (``bench/probe_naps.py``). A brisk wait that lasts longer than
:data:`BRISK_FOR_S` is a rank waiting for another's work, not for the collective: its naps then
grow as a save's do.

A wait that only learns an outcome nobody waits for yet (a save's commit, on a rank with nothing
left to do for it) dozes once it lasts longer than expected (:class:`Waker`): one test every
:data:`POLL_LOOK_S`, woken at once when a save is queued behind it or a thread waits for its
result. Each wake-up is a context switch that a training thread beside it pays for: on 4 ranks
of 2 cores training and saving 1.6 MB every step, 4-6 fewer a step and rank. Dozing at once
instead made each save without training wake twice (the doze, then the nap it cut short).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from .comm import CommError, Request
from .rollcall import RollCall

POLL_SPINS = 20
POLL_NAP_S = 0.0005
POLL_NAP_MAX_S = 0.002
POLL_LOOK_S = 0.05  # the roll call and the deadline looked at this often
BRISK_NAP_S = 0.0001
BRISK_FOR_S = 0.02
PATIENT_S = 0.004  # a wait expected to last this long or more starts with a long nap
# the phases of a save's commit, waited for on the save's background thread only (never the
# training's): straight to ROOT, rank 0 waits in "vote" for the slowest rank's fsync and the
# others in "commit" for rank 0's commit, a few fsyncs long each save; with the node-local
# level, "commit" is the broadcast of rank 0's manifest. (Phase names of mpickpt.save.)
PATIENT = frozenset({"vote", "commit", "drain", "drain-commit"})


def long_nap(expect: float, cap: float, timeout: float) -> float:
    """The nap a wait expected to last ``expect`` s starts with: half of it, at most
    :data:`POLL_LOOK_S` and ``timeout``; none below :data:`PATIENT_S`, nor for a brisk wait
    (``cap`` below :data:`POLL_NAP_S`: a restore's)."""
    if expect < PATIENT_S or cap < POLL_NAP_S:
        return 0.0
    return max(0.0, min(expect / 2, POLL_LOOK_S, timeout))


class Waker:
    """Whether anyone waits for the save thread: the jobs queued behind the one it runs, the
    threads blocked on its results (:meth:`wanted`). A wait of that thread that only learns an
    outcome dozes (:meth:`doze`) while nobody does. (A poll of a result, ``SaveHandle.done()``,
    does not wake it: the next ``save()`` right behind it would wake it a second time.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the two below
        self._wanted = 0
        self._dozing = False
        # held while nobody rang: a doze waits to take it, want() lets it go (a bare lock, not a
        # condition, whose waiter would wake to the ringer's lock still held: two switches)
        self._bell = threading.Lock()
        self._bell.acquire()

    def want(self, n: int) -> None:
        """``n`` more (or fewer) waiting: a job queued (+1), the job starting (-1)."""
        with self._lock:
            self._wanted += n
            ring = self._wanted > 0 and self._dozing
            if ring:
                self._dozing = False
        if ring:
            self._bell.release()

    @contextlib.contextmanager
    def wanted(self) -> Iterator[None]:
        """Around a blocking wait for the save thread's work."""
        self.want(1)
        try:
            yield
        finally:
            self.want(-1)

    def doze(self, seconds: float) -> bool:
        """Nap up to ``seconds`` unless someone waits (or until someone does); whether someone
        does: the wait goes on briskly then. (One thread dozes at a time: the save thread.)"""
        with self._lock:
            if self._wanted > 0:
                return True
            self._dozing = True
        if self._bell.acquire(timeout=max(seconds, 0.0)):
            return True
        with self._lock:
            if self._dozing:  # nobody rang
                self._dozing = False
                return False
        self._bell.acquire()  # rung as the nap ran out: the bell is let go in a moment
        return True


def poll(req: Request, roll: RollCall, timeout: float, cap: float, *,
         expect: float = 0.0, doze: Callable[[float], bool] | None = None,
         sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> str | None:
    """Test ``req`` until it completes (None): :data:`POLL_SPINS` tests, then naps from
    :data:`POLL_NAP_S` doubling up to ``cap`` (up to :data:`POLL_NAP_MAX_S` once
    :data:`BRISK_FOR_S` have passed) between tests, and a look at the roll call and the deadline
    (``timeout`` s from now) every :data:`POLL_LOOK_S`. A wait expected (``expect``) to last
    :data:`PATIENT_S` or more (the same phase's last, on a save: a rank waiting for rank 0's
    commit, which waits for the disk) is tested once, naps :func:`long_nap` (half of it), then
    naps as above with no tests in a row: each wake-up is a context switch that a training
    thread pays for. (Not longer naps after that one: the ranks of a collective wait for each
    other's tests, MPI's progress, and naps of a quarter of the last wait grew the waits of a
    4-rank save from 20 ms to 300 ms.) With ``doze`` (:meth:`Waker.doze`: an outcome nobody
    waits for yet), a wait still not done when it was expected to be (:data:`PATIENT_S` at
    least) dozes instead, naps of :data:`POLL_LOOK_S` with a test and a look at the roll call
    and the deadline after each, until ``doze`` says someone waits: then as above. Else what
    stopped it: "" (the deadline, or rank 0's roll call, looked at once the long nap is over) or
    the MPI error, in parentheses."""
    start = clock()
    deadline = start + timeout
    spins, look, nap = 0, 0.0, min(POLL_NAP_S, cap)
    first = long_nap(expect, cap, timeout)
    doze_after = max(PATIENT_S, 2 * first)  # (when it was expected to be done)
    try:
        if first:  # known to be long: no spinning
            if req.test():
                return None
            sleep(first)
            spins = POLL_SPINS
        while not req.test():
            spins += 1
            if spins > POLL_SPINS:
                now = clock()
                if now >= look:  # the roll call and the deadline, a few times a second
                    if roll.alarmed() or now > deadline:
                        return ""
                    look = now + POLL_LOOK_S
                if doze is not None and now - start >= doze_after:
                    if not doze(POLL_LOOK_S):  # nobody waits for it: one test a doze
                        look = 0.0
                        continue
                    doze = None  # someone does: on as before
                if now - start > BRISK_FOR_S:
                    cap = max(cap, POLL_NAP_MAX_S)
                sleep(nap)
                nap = min(2 * nap, cap)
    except CommError as e:
        return f" ({e})"
    return None


class _Counted:
    """A request that counts its tests."""

    __slots__ = ("req", "tests")

    def __init__(self, req: Request) -> None:
        self.req, self.tests = req, 0

    def test(self) -> bool:
        self.tests += 1
        return self.req.test()


class Patience:
    """How long the last wait of each of the :data:`PATIENT` phases lasted: what :func:`poll`
    expects of that phase's next wait."""

    def __init__(self) -> None:
        self.lasted: dict[str, float] = {}

    def poll(self, req: Request, roll: RollCall, phase: str, timeout: float, cap: float, *,
             doze: Callable[[float], bool] | None = None,
             sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> str | None:
        """:func:`poll` ``req``, as a wait of ``phase``. A wait done at the first test after
        its long nap counts as long as the nap asked for, not as long as it took to wake up
        (else a late wake-up, the interpreter's lock or a busy CPU, would keep every later wait
        of the phase patient, the expectation settling at twice the lateness). A wait that
        dozed a whole nap (``doze``, see :func:`poll`) is not kept: nobody waited for it."""
        if phase not in PATIENT:  # (a restore's, the training thread's: nothing kept)
            return poll(req, roll, timeout, cap, doze=doze, sleep=sleep, clock=clock)
        start, expect = clock(), self.lasted.get(phase, 0.0)
        counted, slept = _Counted(req), []

        def dozing(seconds: float) -> bool:
            woken = doze(seconds)  # type: ignore[misc]
            if not woken:
                slept.append(seconds)
            return woken

        error = poll(counted, roll, timeout, cap, expect=expect,
                     doze=dozing if doze is not None else None, sleep=sleep, clock=clock)
        if error is None and not slept:
            first = long_nap(expect, cap, timeout)
            took = clock() - start
            self.lasted[phase] = min(took, first) if first and counted.tests == 2 else took
        return error
