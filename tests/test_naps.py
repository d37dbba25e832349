"""How a rank waits for a collective: tests, then naps that grow up to a cap; a restore's
collectives (``Protocol.brisk``) nap at most ``BRISK_NAP_S``, a save's up to ``POLL_NAP_MAX_S``."""

from __future__ import annotations

import pytest
import torch

import mpickpt
from mpickpt.mpi import protocol
from mpickpt.mpi.protocol import BRISK_NAP_S, POLL_NAP_MAX_S, POLL_SPINS, Protocol

pytestmark = pytest.mark.quick


class Later:
    """A request that completes at its ``n``-th test."""

    def __init__(self, n: int) -> None:
        self.left = n

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0


@pytest.fixture
def naps(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(protocol.time, "sleep", slept.append)
    return slept


def test_naps_grow_to_their_cap_and_stay_short_within_brisk(naps):
    proto = Protocol()
    proto.complete(Later(POLL_SPINS + 12), proto._roll, "slow")
    assert max(naps) == POLL_NAP_MAX_S and min(naps) < POLL_NAP_MAX_S
    naps.clear()
    with proto.brisk():
        proto.complete(Later(POLL_SPINS + 12), proto._roll, "slow")
    assert len(naps) == 11 and max(naps) <= BRISK_NAP_S
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
