"""Point-to-point transfers (Protocol.start): each receive is reported as it arrives, from the
transfer thread, with its bytes in place (what a restore's copies to the GPU start from)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mpickpt.mpi.protocol import Protocol

pytestmark = pytest.mark.quick


def test_each_receive_is_reported_once_with_its_bytes_in_place():
    proto = Protocol()  # this process alone: it sends to itself
    try:
        sends = [np.full(1 << 16, i + 1, dtype=np.uint8) for i in range(5)]
        recvs = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(5)]
        seen: list[tuple[int, bool, str]] = []

        def received(i: int) -> None:
            seen.append((i, bool((recvs[i] == i + 1).all()), threading.current_thread().name))

        pending = proto.start([(b, proto.rank) for b in sends],
                              [(b, proto.rank) for b in recvs], "test", received)
        pending.wait()
        assert sorted(i for i, _, _ in seen) == list(range(5))  # receives only, each once
        assert all(ok for _, ok, _ in seen)
        assert all(name.startswith("mpickpt-transfer") for _, _, name in seen)
        assert all((r == i + 1).all() for i, r in enumerate(recvs))
    finally:
        proto.free()
