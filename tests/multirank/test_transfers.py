"""The protocol's point-to-point transfers between real MPI ranks."""

from __future__ import annotations

import pytest
from harness import SCENARIOS, run_mpi


@pytest.mark.quick
def test_grouped_receives_arrive_where_asked_with_a_bounded_window_of_groups_in_flight():
    job = run_mpi(2, [str(SCENARIOS / "transfers.py")], timeout=120)
    assert job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"rank {rank}: 10 groups in, at most" in job.stdout, job.output
