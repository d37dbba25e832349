"""How the protocol waits for a collective (mpickpt/mpi/protocol.py): a "patient" wait (the save
thread's vote and outcome, which nobody stands behind) sleeps through most of what the same
phase took last time before it tests, instead of testing and napping from the start; it keeps
the deadline. One rank, requests that complete at a set time."""

from __future__ import annotations

import time

import pytest

from mpickpt.mpi.protocol import LAZY_SHARE, POLL_SPINS, CollectiveTimeout, Protocol

pytestmark = pytest.mark.quick


class Later:
    """A request that completes ``after`` seconds from now; counts its tests."""

    def __init__(self, after: float) -> None:
        self.at, self.tests = time.monotonic() + after, 0

    def test(self) -> bool:
        self.tests += 1
        return time.monotonic() >= self.at


@pytest.fixture
def proto():
    p = Protocol(None, timeout=30)
    yield p
    p.free()


def test_a_patient_wait_sleeps_through_most_of_the_last_ones_before_testing(proto):
    first = Later(0.05)
    proto._wait(first, "vote", patient=True)  # nothing known yet: polls as any wait does
    assert first.tests > POLL_SPINS
    took = proto._took["vote"]
    assert 0.05 <= took < 0.5
    second = Later(0.05)
    t = time.monotonic()
    proto._wait(second, "vote", patient=True)
    assert time.monotonic() - t >= 0.05
    # one test, a sleep of LAZY_SHARE of the last wait, then naps for the rest
    assert LAZY_SHARE * took > 0.03 and second.tests < POLL_SPINS, (took, second.tests)
    impatient = Later(0.05)
    proto._wait(impatient, "vote")
    assert impatient.tests > POLL_SPINS
    other = Later(0.05)  # patience is per phase
    proto._wait(other, "outcome", patient=True)
    assert other.tests > POLL_SPINS


def test_a_patient_wait_keeps_the_deadline():
    p = Protocol(None, timeout=0.3)
    try:
        p._took["vote"] = 10.0  # a long wait last time: the first nap is still bounded
        t = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="phase 'vote'"):
            p._wait(Later(60), "vote", patient=True)
        assert time.monotonic() - t < 5
    finally:
        p.free()
