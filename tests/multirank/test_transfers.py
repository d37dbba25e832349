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


@pytest.mark.quick
def test_a_partner_stream_sends_each_window_once_it_has_landed(tmp_path):
    job = run_mpi(2, [str(SCENARIOS / "stream_landing.py"), str(tmp_path)], timeout=120)
    assert job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"rank {rank}: landed: the copy holds the landed bytes" in job.stdout, job.output
    assert "rank 0: failed: the failed landing reported" in job.stdout, job.output
    assert "rank 1: failed: received all" in job.stdout, job.output
