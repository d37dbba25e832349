"""Who did not arrive: a roll call, paid only when a deadline passes.

The collectives on one communicator are numbered in the order every rank runs them, so a rank
waiting in collective S knows that every rank completed S-1 (a barrier or allreduce completes
only once all have joined; a gather on a rank that only sends does not count): that is where a
missing rank was last seen. When rank 0's deadline passes, or another rank's alarm reaches it (a
non-zero rank whose deadline passes sends one), rank 0 calls the roll: a message to every rank;
each rank polling in a collective answers where it waits; after ``grace`` seconds the ranks that
did not answer are the missing ones, and rank 0 sends the report to every rank, which each logs.
Without an answer from rank 0 within ``grace``, a rank reports that rank 0 is missing, with what
it knows itself. O(N) messages, all point to point with rank 0, only after a deadline passed;
none while the job is healthy beyond one ``Iprobe`` per poll of a collective that waits.
"""

from __future__ import annotations

import time
from typing import Any

from ..ranks import ranks_text, spans, unspan

# point-to-point tags of the roll call on the private communicators (collectives never match them)
TAG_ALARM, TAG_CALL, TAG_HERE, TAG_REPORT = 0x6D71, 0x6D72, 0x6D73, 0x6D74  # <= 32767, always valid


class RollCall:
    """The collectives of one communicator, numbered, and the roll call when one misses its
    deadline (see the module docstring). Used by one thread at a time."""

    def __init__(self, comm: Any, grace: float) -> None:
        self.comm = comm  # a mpickpt.mpi.comm.Comm
        self.rank: int = comm.rank
        self.size: int = comm.size
        self.grace = grace
        self.seq = 0  # the collective this rank is in, or last was in
        self.where = ""  # its name, e.g. "phase 'vote' (collective #8)"
        self.last_done = "the creation of this communicator"
        self._heard: dict[str, Any] | None = None  # rank 0: an alarm; the others: a call
        self._report: dict[str, Any] | None = None
        self.coordinated = False  # whether rank 0's report came (else rank 0 was silent)

    def enter(self, where: str) -> None:
        self.seq += 1
        self.where = where

    def complete(self) -> None:
        self.last_done = self.where

    # -------------------------------------------------------------------------------- messages

    def _send(self, obj: dict[str, Any], dest: int, tag: int) -> None:
        self.comm.post(obj, dest, tag)  # a dead peer: it is reported missing anyway

    def _take(self, tag: int) -> tuple[int, dict[str, Any]] | None:
        """A message of ``tag`` that has arrived (any source), or None."""
        return self.comm.take(tag)

    def alarmed(self) -> bool:
        """Cheap check while waiting: rank 0, did another rank's deadline pass? Others: did rank
        0 call the roll (or already report)?"""
        if self._heard is not None or self._report is not None:
            return True
        got = self._take(TAG_ALARM if self.rank == 0 else TAG_CALL)
        if got is not None:
            self._heard = {**got[1], "from": got[0]}
            return True
        if self.rank != 0:
            got = self._take(TAG_REPORT)
            if got is not None:
                self._report = got[1]
                return True
        return False

    # ------------------------------------------------------------------------------- roll call

    def account(self) -> str:
        """After a missed deadline (or an alarm): who did not arrive, as text for the error."""
        return self._lead() if self.rank == 0 else self._follow()

    def _me(self) -> dict[str, Any]:
        return {"seq": self.seq, "where": self.where}

    def _lead(self) -> str:
        """Rank 0: call the roll, wait ``grace`` for the answers, report to every rank."""
        here: dict[int, str] = {0: self.where}
        if self._heard is not None:
            here[int(self._heard["from"])] = str(self._heard.get("where", "?"))
        for r in range(1, self.size):
            self._send(self._me(), r, TAG_CALL)
        end = time.monotonic() + self.grace
        while len(here) < self.size and time.monotonic() < end:
            got = self._take(TAG_HERE) or self._take(TAG_ALARM)
            if got is None:
                time.sleep(0.002)
            else:
                here[got[0]] = str(got[1].get("where", "?"))
        missing = [r for r in range(self.size) if r not in here]
        groups: dict[str, list[int]] = {}
        for r, where in here.items():
            groups.setdefault(where, []).append(r)
        report = {"missing": spans(missing), "last": self.last_done,
                  "answered": {w: spans(rs) for w, rs in groups.items()}}
        for r in range(1, self.size):
            self._send(report, r, TAG_REPORT)
        self.coordinated = True
        return self._describe(report)

    def _follow(self) -> str:
        """Rank R > 0: alarm rank 0 (unless it already called), answer its call, await the
        report; without one in time, say so and what this rank knows itself."""
        if self._heard is None and self._report is None:
            self._send(self._me(), 0, TAG_ALARM)
        end = time.monotonic() + self.grace
        answered = False
        while self._report is None:
            if self._heard is not None and not answered:
                self._send(self._me(), 0, TAG_HERE)  # (an alarm already counts as an answer)
                answered = True
                end = time.monotonic() + 2 * self.grace  # rank 0 waits grace for the others
            got = self._take(TAG_REPORT)
            if got is not None:
                self._report = got[1]
                break
            if time.monotonic() > end:
                break
            if self._heard is None:
                got = self._take(TAG_CALL)
                if got is not None:
                    self._heard = got[1]
                    continue
            time.sleep(0.002)
        if self._report is not None:
            self.coordinated = True
            return self._describe(self._report)
        if self._heard is None:
            return (f"rank 0 did not answer within {self.grace:g} s, so rank 0 did not arrive "
                    f"(last seen in {self.last_done}, the last collective every rank completed); "
                    f"whether other ranks are missing is unknown")
        return (f"rank 0 called the roll but sent no report within {2 * self.grace:g} s; every "
                f"rank completed {self.last_done}")

    def _describe(self, report: dict[str, Any]) -> str:
        missing = unspan(report.get("missing", []))
        groups = sorted(report.get("answered", {}).items(), key=lambda kv: kv[1][0][0])
        answered = " and ".join(f"{ranks_text(unspan(s))} waiting in {w}" for w, s in groups)
        if not missing:
            return (f"every rank answered rank 0's roll call ({answered}): a rank arrived after "
                    f"the deadline")
        return (f"did not arrive: {ranks_text(missing)}, last seen in {report.get('last')}; "
                f"rank 0's roll call was answered within {self.grace:g} s by {answered}")
