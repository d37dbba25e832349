"""What the training thread and the save pipeline hand each other: a :class:`SaveRequest` in,
a :class:`SaveHandle` back at once, a :class:`SaveResult` when the save has committed or aborted
on every rank; and rank 0's logs of saves that wait for, or skip past, earlier ones.

Both :mod:`mpickpt.save.capture` (the training thread's side) and :mod:`mpickpt.save.pipeline` (the
pipeline's) import from here; neither imports the other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .. import sharding
from ..errors import RankFailure, SaveAborted
from ..format.records import TensorRecord
from ..mpi.polling import Waker
from .snapshot import Snapshot


@dataclass
class SaveResult:
    """What became of one save; the same on every rank."""

    step: int
    committed: bool
    path: str | None = None
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # as committed in the manifest
    level: str = "root"  # where it committed: "root", or "local" (protected on the nodes)
    skipped: bool = False  # if_busy="skip": not taken, an earlier save was still persisting
    failures: list[RankFailure] = field(default_factory=list)  # of an aborted save, per rank


class SaveHandle:
    """Returned by :meth:`Checkpointer.save`: ``done()`` polls, ``wait()`` gives the
    :class:`SaveResult` once the checkpoint is committed or aborted on every rank."""

    def __init__(self, step: int, future: Future[SaveResult], raise_on_error: bool,
                 waker: Waker | None = None) -> None:
        self.step = step
        self._future = future
        self._raise = raise_on_error
        self._waker = waker  # told while the outcome is waited for (the save thread may doze)
        self.reported = False  # whether the caller has seen the outcome through wait()

    def done(self) -> bool:
        """Whether the outcome is known here (on the ranks other than rank 0, a save nobody
        waits for learns it within 50 ms of the commit: see :class:`~mpickpt.mpi.polling.Waker`)."""
        return self._future.done()

    def outcome(self) -> SaveResult:
        """The result, once there is one; never raises for an aborted save."""
        return self._result(None)

    def _result(self, timeout: float | None) -> SaveResult:
        if self._future.done() or self._waker is None:
            return self._future.result(timeout)
        with self._waker.wanted():
            return self._future.result(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(self)`` once the outcome is known (on the thread that learns it)."""
        self._future.add_done_callback(lambda _: fn(self))

    def wait(self, timeout: float | None = None) -> SaveResult:
        result = self._result(timeout)
        self.reported = True
        if self._raise and not result.committed and not result.skipped:
            raise SaveAborted(f"checkpoint of step {result.step} aborted: {result.error}")
        return result


@dataclass
class SaveRequest:
    """What the training thread hands the pipeline: a snapshot and what describes it, or the
    error that stopped it (the save is then aborted on every rank)."""

    step: int
    snapshot: Snapshot | None
    tree: dict[str, Any] | None
    placements: dict[str, sharding.Placement]
    metadata: dict[str, Any]  # checked; CUDA scalars resolved on rank 0 at the commit
    stats: dict[str, float]
    error: str | None = None
    drain: bool = False  # with a local level: drain this one to ROOT whatever persist_every says
    busy: bool = False  # if_busy="skip" and every buffer was in flight: no snapshot taken
    # incremental, frozen=: tensors not snapshotted, referred to (see Tracker.elide)
    elided: dict[str, TensorRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


class WaitLog:
    """Rank 0 says once when saves start waiting for earlier ones, and once when they stop."""

    def __init__(self, logger: logging.Logger, slots: int) -> None:
        self.log, self.slots = logger, slots
        self._waits: list[float] = []  # the seconds each save of a run of waits waited

    def saw(self, step: int, waited: bool, seconds: float) -> None:
        if waited:
            if not self._waits:
                self.log.info("save of step %d waits for an earlier save to finish persisting "
                              "(waited %.2f s, max_in_flight=%d): saves come faster than they "
                              "persist; the next waits are logged once they end", step,
                              seconds, self.slots)
            self._waits.append(seconds)
        elif self._waits:
            self.log.info("saves no longer wait: %d in a row waited for an earlier one, %.2f s "
                          "in all", len(self._waits), sum(self._waits))
            self._waits = []


class SkipLog:
    """if_busy="skip": rank 0 says once when saves start being skipped, and once when a save is
    taken again (how many were skipped)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log, self.skipped, self.total = logger, 0, 0

    def saw(self, step: int, skipped: bool) -> None:
        if skipped:
            if not self.skipped and self.total == 0:
                self.log.info("save of step %d skipped: an earlier save was still persisting "
                              "(if_busy='skip'); skips are counted and logged when they stop",
                              step)
            self.skipped += 1
            self.total += 1
        elif self.skipped:
            self.log.info("save of step %d taken after %d skipped (%d skipped in all)", step,
                          self.skipped, self.total)
            self.skipped = 0
