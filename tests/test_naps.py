"""How a rank waits for a collective (mpickpt/mpi/polling.py): tests, then naps that grow up to a
cap; a restore's collectives (``Protocol.brisk``) nap at most ``BRISK_NAP_S`` while the wait is
short, a save's up to ``POLL_NAP_MAX_S``."""

from __future__ import annotations

import pytest
import torch

import mpickpt
from mpickpt.mpi.polling import BRISK_FOR_S, BRISK_NAP_S, POLL_NAP_MAX_S, POLL_SPINS, poll
from mpickpt.mpi.protocol import Protocol

pytestmark = pytest.mark.quick


class Later:
    """A request that completes at its ``n``-th test."""

    def __init__(self, n: int) -> None:
        self.left = n

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0


def waited(cap: float, tests: int) -> list[float]:
    """The naps of :func:`poll` for a request that completes at its ``tests``-th test, at
    ``cap``, on a clock that each nap moves on."""
    now, naps = [0.0], []

    def sleep(s: float) -> None:
        naps.append(s)
        now[0] += s

    assert poll(Later(tests), Protocol()._roll, 900.0, cap, sleep=sleep,
                clock=lambda: now[0]) is None
    return naps


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

    def recording(self, req, roll, phase):
        seen.append((phase, self.nap_max))
        return complete(self, req, roll, phase)

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
