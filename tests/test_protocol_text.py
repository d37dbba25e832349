"""mpi/protocol.py: the failures of many ranks read once per reason, not once per rank."""

from __future__ import annotations

from mpickpt.errors import RankFailure
from mpickpt.mpi.protocol import Failures


def test_a_reason_given_alike_by_many_ranks_is_said_once_after_their_ranks():
    records = [RankFailure(r, "restore", f"rank {r}: tensor 'w' of step 3 has shape [4]")
               for r in range(32) if r != 7]
    records.insert(7, RankFailure(7, "restore", "rank 7: its shard is missing"))
    records.append(RankFailure(40, "restore", "disk full"))
    records.append(RankFailure(41, "restore", "disk full"))
    text = str(Failures(tuple(records)))
    assert text == ("ranks 0-6,8-31: tensor 'w' of step 3 has shape [4]; "
                    "rank 7: its shard is missing; disk full; disk full")
    two = str(Failures((RankFailure(1, "x", "rank 1: late"), RankFailure(2, "x", "rank 2: late"))))
    assert two == "rank 1: late; rank 2: late"
