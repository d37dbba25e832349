"""How a rank waits for a collective (mpickpt/mpi/polling.py): tests, then naps that grow up to a
cap; a restore's collectives (``Protocol.brisk``) nap at most ``BRISK_NAP_S`` while the wait is
short, a save's up to ``POLL_NAP_MAX_S``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mpickpt
from mpickpt.mpi.polling import (
    BRISK_FOR_S,
    BRISK_NAP_S,
    PATIENT,
    PATIENT_S,
    POLL_LOOK_S,
    POLL_NAP_MAX_S,
    POLL_NAP_S,
    POLL_SPINS,
    Patience,
    Waker,
    poll,
)
from mpickpt.mpi.protocol import Protocol

pytestmark = pytest.mark.quick


class Later:
    """A request that completes at its ``n``-th test."""

    def __init__(self, n: int) -> None:
        self.left = n

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0


def waited(cap: float, tests: int, expect: float = 0.0) -> list[float]:
    """The naps of :func:`poll` for a request that completes at its ``tests``-th test, at
    ``cap``, on a clock that each nap moves on."""
    now, naps = [0.0], []

    def sleep(s: float) -> None:
        naps.append(s)
        now[0] += s

    assert poll(Later(tests), Protocol()._roll, 900.0, cap, expect=expect, sleep=sleep,
                clock=lambda: now[0]) is None
    return naps


class At:
    """A request that completes once its clock reads ``when``; counts its tests."""

    def __init__(self, now: list[float], when: float) -> None:
        self.now, self.when, self.tests = now, when, 0

    def test(self) -> bool:
        self.tests += 1
        return self.now[0] >= self.when


def timed_wait(lasts: float, expect: float, cap: float = POLL_NAP_MAX_S
               ) -> tuple[list[float], int]:
    """The naps and tests of :func:`poll` for a request done ``lasts`` s from now, as a wait
    expected to take ``expect`` s, on a clock that each nap moves on."""
    now, naps = [0.0], []

    def sleep(s: float) -> None:
        naps.append(s)
        now[0] += s

    req = At(now, lasts)
    assert poll(req, Protocol()._roll, 900.0, cap, expect=expect, sleep=sleep,
                clock=lambda: now[0]) is None
    return naps, req.tests


def test_a_saves_naps_grow_to_their_cap():
    naps = waited(POLL_NAP_MAX_S, POLL_SPINS + 12)
    assert len(naps) == 11 and naps == sorted(naps)
    assert naps[0] < POLL_NAP_MAX_S and naps[-1] == POLL_NAP_MAX_S


def test_brisk_naps_stay_short_then_grow_once_the_wait_lasts():
    naps = waited(BRISK_NAP_S, POLL_SPINS + 400)
    brisk = int(BRISK_FOR_S / BRISK_NAP_S)  # naps before BRISK_FOR_S have passed
    assert max(naps[:brisk]) <= BRISK_NAP_S
    assert naps[-1] == POLL_NAP_MAX_S  # a rank waiting for another's work: a save's naps
    proto = Protocol()
    with proto.brisk():
        assert proto.nap_max == BRISK_NAP_S
        assert proto.sub(0, 0).nap_max == BRISK_NAP_S  # (an XOR team formed in a restore)
    with pytest.raises(RuntimeError), proto.brisk():  # the cap comes back whatever happens
        raise RuntimeError("inside")
    assert proto.nap_max == POLL_NAP_MAX_S


def test_a_restores_collectives_are_brisk_and_a_saves_are_not(tmp_path, monkeypatch):
    seen: list[tuple[str, float]] = []
    complete = Protocol.complete

    def recording(self, req, roll, phase, *args):
        seen.append((phase, self.nap_max))
        return complete(self, req, roll, phase, *args)

    monkeypatch.setattr(Protocol, "complete", recording)
    state = {"w": torch.arange(10.0)}
    with mpickpt.Checkpointer(str(tmp_path / "root"), on_error="raise") as ck:
        ck.save(1, state).wait()
        saved = list(seen)
        seen.clear()
        state["w"].zero_()
        assert ck.restore(state) == 1
        restored = list(seen)
        seen.clear()
        ck.save(2, state).wait()
    assert torch.equal(state["w"], torch.arange(10.0))
    assert saved and all(cap == POLL_NAP_MAX_S for _, cap in saved)
    assert restored and all(cap == BRISK_NAP_S for _, cap in restored), restored
    assert seen and all(cap == POLL_NAP_MAX_S for _, cap in seen)


def test_a_wait_known_to_be_long_naps_through_half_of_it_without_spinning():
    # a rank waiting 20 ms for rank 0's commit, as it did the save before
    naps, tests = timed_wait(0.020, expect=0.020)
    assert naps[0] == pytest.approx(0.010) and sum(naps) >= 0.020
    assert len(naps) <= 8 and tests == len(naps) + 1  # one test per wake-up, none in a row
    plain, plain_tests = timed_wait(0.020, expect=0.0)
    assert plain_tests >= POLL_SPINS and len(plain) > len(naps)
    # the same wait a brisk restore makes: no long nap, whatever the last one lasted
    brisk, _ = timed_wait(0.020, expect=0.020, cap=BRISK_NAP_S)
    assert max(brisk) <= POLL_NAP_MAX_S and brisk[0] <= BRISK_NAP_S
    # a short wait expected, or a long one already done: no nap at all
    assert waited(POLL_NAP_MAX_S, 1, expect=0.020) == []
    assert waited(POLL_NAP_MAX_S, POLL_SPINS + 2, expect=PATIENT_S / 2)[0] == POLL_NAP_S


class Alarmed:
    """Rank 0's roll call, heard: a dead rank was reported."""

    def alarmed(self) -> bool:
        return True


def test_a_long_nap_never_outlasts_the_deadline_or_the_roll_call():
    naps, _ = timed_wait(0.5, expect=10.0)
    assert max(naps) <= POLL_LOOK_S
    for roll, timeout in ((Protocol()._roll, 0.2), (Alarmed(), 900.0), (Protocol()._roll, -1.0)):
        assert stopped_after(roll, timeout) <= max(timeout, 0) + POLL_LOOK_S + POLL_NAP_MAX_S


def stopped_after(roll, timeout: float) -> float:
    """How long :func:`poll` waits, as a wait expected to be long, for a request that never
    completes, until the deadline or ``roll``'s alarm stops it."""
    now = [0.0]

    def sleep(s: float) -> None:
        assert s >= 0  # (a negative timeout: no nap, the deadline is past)
        now[0] += s

    never = At(now, float("inf"))
    assert poll(never, roll, timeout, POLL_NAP_MAX_S, expect=10.0, sleep=sleep,
                clock=lambda: now[0]) == ""  # as without an expectation
    return now[0]


def test_a_phase_that_became_short_stops_napping_long_however_late_its_naps_end():
    """A nap that ends 3 ms late (the interpreter's lock, a busy CPU) must not keep a 1 ms wait
    patient: the wait done at the first test after its long nap counts as that nap."""
    now = [0.0]

    def late(s: float) -> None:
        now[0] += s + 0.003

    patience = Patience()
    patience.lasted["commit"] = 0.020  # the last save's commit, a slow disk's
    for _ in range(6):
        req = At(now, now[0] + 0.001)
        assert patience.poll(req, Protocol()._roll, "commit", 900.0, POLL_NAP_MAX_S,
                             sleep=late, clock=lambda: now[0]) is None
    assert patience.lasted["commit"] < PATIENT_S
    naps: list[float] = []
    req = At(now, now[0] + 0.001)
    assert patience.poll(req, Protocol()._roll, "commit", 900.0, POLL_NAP_MAX_S,
                         sleep=lambda s: (naps.append(s), late(s)),
                         clock=lambda: now[0]) is None
    assert not naps or naps[0] <= POLL_NAP_S  # no long nap any more
    patience.poll(At(now, 0.0), Protocol()._roll, "restore", 900.0, POLL_NAP_MAX_S)
    assert "restore" not in patience.lasted  # only a save's commit phases are kept


def test_only_a_saves_commit_phases_expect_their_last_wait(tmp_path, monkeypatch):
    import mpickpt.mpi.polling as polling

    expected: dict[str, list[float]] = {}
    real = polling.poll

    def recording(req, roll, timeout, cap, *, expect=0.0, **kw):
        expected.setdefault(phase[0], []).append(expect)
        return real(req, roll, timeout, cap, expect=expect, **kw)

    phase = [""]
    complete = Protocol.complete

    def naming(self, req, roll, ph, *args):
        phase[0] = ph
        return complete(self, req, roll, ph, *args)

    monkeypatch.setattr(polling, "poll", recording)
    monkeypatch.setattr(Protocol, "complete", naming)
    state = {"w": torch.arange(10.0)}
    with mpickpt.Checkpointer(str(tmp_path / "root"), on_error="raise") as ck:
        for step in (1, 2, 3):
            ck.save(step, state).wait()
        ck.restore(state)
    assert {"vote", "commit"} <= set(expected) and {"vote", "commit"} <= PATIENT
    for ph, seen in expected.items():
        if ph not in PATIENT:
            assert set(seen) == {0.0}, (ph, seen)  # the training thread's waits never nap long
        else:
            assert seen[0] == 0.0  # then the last one's
    assert any(e > 0.0 for e in expected["vote"][1:])  # the first save's wait, at the second


def dozed(lasts: float, woken_at: int | None = None, roll=None, timeout: float = 900.0,
          expect: float = 0.0) -> tuple[list[float], list[float], int, str | None]:
    """The dozes and naps of :func:`poll` for a request done ``lasts`` s from now, waited for
    idly (``doze``); someone waits from the ``woken_at``-th doze on; on a clock that each doze
    and nap moves on."""
    now, dozes, naps = [0.0], [], []

    def doze(s: float) -> bool:
        dozes.append(s)
        woken = woken_at is not None and len(dozes) >= woken_at
        now[0] += 0.0 if woken else s
        return woken

    def sleep(s: float) -> None:
        naps.append(s)
        now[0] += s

    req = At(now, lasts)
    error = poll(req, roll or Protocol()._roll, timeout, POLL_NAP_MAX_S, expect=expect,
                 doze=doze, sleep=sleep, clock=lambda: now[0])
    return dozes, naps, req.tests, error


def test_an_outcome_nobody_waits_for_dozes_once_it_is_late():
    # no expectation: tests and naps, as any wait, for PATIENT_S; then a test a doze
    dozes, naps, tests, error = dozed(0.12)
    assert error is None and dozes and all(d == POLL_LOOK_S for d in dozes)
    assert PATIENT_S <= sum(naps) < PATIENT_S + POLL_NAP_MAX_S
    assert naps == waited(POLL_NAP_MAX_S, POLL_SPINS + len(naps) + 1)[:len(naps)]
    assert sum(naps) + sum(dozes) >= 0.12 > sum(naps) + sum(dozes) - POLL_LOOK_S
    assert tests == POLL_SPINS + 1 + len(naps) + len(dozes)
    # expected to last 20 ms, as the last one did: its long nap, then naps until 20 ms, then dozes
    dozes, naps, tests, error = dozed(0.12, expect=0.020)
    assert error is None and naps[0] == 0.010 and 0.020 <= sum(naps) < 0.020 + POLL_NAP_MAX_S
    assert dozes and tests == 1 + len(naps) + len(dozes)
    # done when expected: no doze, the naps and tests of any wait
    for lasts, expect in ((0.003, 0.0), (0.020, 0.020), (0.001, 0.010)):
        dozes, naps, tests, error = dozed(lasts, expect=expect)
        assert error is None and dozes == []
        assert (naps, tests) == timed_wait(lasts, expect=expect), (lasts, expect)


def test_once_someone_waits_for_the_outcome_it_is_waited_for_as_without_dozes():
    for expect in (0.0, 0.020):
        plain = timed_wait(0.12, expect=expect)
        dozes, naps, tests, error = dozed(0.12, woken_at=1, expect=expect)  # waited for at once
        assert error is None and len(dozes) == 1 and (naps, tests) == plain
        dozes, naps, tests, error = dozed(0.12, woken_at=2, expect=expect)  # after a doze
        assert error is None and len(dozes) == 2 and max(naps[-3:]) == POLL_NAP_MAX_S


def test_a_doze_never_outlasts_the_deadline_or_the_roll_call():
    for roll, timeout in ((Protocol()._roll, 0.2), (Alarmed(), 900.0)):
        dozes, _, _, error = dozed(float("inf"), roll=roll, timeout=timeout)
        assert error == "" and sum(dozes) <= timeout + POLL_LOOK_S


def test_a_waker_wakes_a_doze_when_a_job_is_queued_or_a_result_waited_for():
    waker = Waker()
    assert waker.doze(0.0) is False  # nobody waits
    with waker.wanted():
        assert waker.doze(5.0) is True and waker.doze(5.0) is True  # as long as someone waits
    assert waker.doze(0.0) is False
    got: list[tuple[bool, float]] = []

    def dozing() -> None:
        t = time.monotonic()
        got.append((waker.doze(30.0), time.monotonic() - t))

    thread = threading.Thread(target=dozing)
    thread.start()
    time.sleep(0.1)
    waker.want(1)  # from another thread, mid-doze: a job queued
    thread.join(10.0)
    assert got and got[0][0] is True and 0.05 <= got[0][1] < 10.0, got
    waker.want(-1)  # the job started
    assert waker.doze(0.0) is False
