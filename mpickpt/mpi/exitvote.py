"""The exit vote: whether any rank wants to stop, agreed at the same step on every rank, at the
cost of one non-blocking allreduce per step (see :class:`ExitVote`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .comm import Request
from .rollcall import RollCall

if TYPE_CHECKING:
    from .protocol import Protocol


class ExitVote:
    """Agree across ranks whether any rank wants to stop, without a blocking collective per step.

    Every rank calls :meth:`poll` once per training step. A call completes the allreduce (MAX)
    started by the previous call, which every rank posted a step ago, so in a job whose ranks
    move in step the wait is nil, and starts the next one with this rank's flag. All ranks learn
    a raised flag at the same call, hence at the same step. Its own communicator keeps it apart
    from the saves running on the background thread. The wait has the protocol's deadline: a rank
    that stops calling (dead, hung) makes the others raise :class:`CollectiveTimeout`, naming it.
    """

    PHASE = "should_exit"

    def __init__(self, proto: Protocol, on_first: Callable[[], None] | None = None) -> None:
        """``on_first`` is called once, when the first allreduce completes: every rank has
        called :meth:`poll` by then (the job template's ready handshake)."""
        self._proto = proto
        self._on_first = on_first
        self.comm = proto.comm.dup()
        self._roll = RollCall(self.comm, proto.grace)
        self._send = np.zeros(2, dtype=np.int64)
        self._recv = np.zeros(2, dtype=np.int64)
        self._req: Request | None = None
        self._label = ""

    def _complete(self) -> None:
        assert self._req is not None
        self._roll.enter(self._label)
        self._proto.complete(self._req, self._roll, self.PHASE)
        self._roll.complete()
        self._req = None
        if self._on_first is not None:
            first, self._on_first = self._on_first, None
            first()

    def poll(self, flag: int, rank: int, step: int | None = None) -> tuple[int, int] | None:
        """None while every rank's flag is 0; else (the highest flag, the highest rank that
        raised a flag). ``step`` only names the call in a report."""
        agreed = None
        if self._req is not None:
            self._complete()
            if self._recv[0]:
                agreed = int(self._recv[0]), int(self._recv[1]) - 1
        if agreed is None:
            self._send[:] = (flag, rank + 1 if flag else 0)
            self._label = (f"phase {self.PHASE!r} (call #{self._roll.seq + 1}"
                           f"{f', step {step}' if step is not None else ''})")
            self._req = self.comm.iallreduce(self._send, self._recv, "max")
        return agreed

    def free(self) -> None:
        """Collective: complete the allreduce in flight (every rank has the same one), release."""
        if self._req is not None:
            self._complete()
        self.comm.free()
