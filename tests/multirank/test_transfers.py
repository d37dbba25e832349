"""The protocol's point-to-point transfers between real MPI ranks."""

from __future__ import annotations

import re

import pytest
from harness import SCENARIOS, run_mpi


@pytest.mark.quick
def test_grouped_receives_arrive_where_asked_with_a_bounded_window_of_groups_in_flight():
    job = run_mpi(2, [str(SCENARIOS / "transfers.py")], timeout=120)
    assert job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"rank {rank}: 10 groups in, at most" in job.stdout, job.output


@pytest.mark.quick
def test_objects_broadcast_and_gathered_arrive_whole_whatever_their_size():
    """Tree collectives and flat ones (a save's vote and outcome). Flat: rank 3 has rank 0's
    broadcast, and rank 0 the gather, while rank 2 sleeps 3 s without a test (in a tree, rank 2
    forwards rank 3's part); a root that comes last to three gathers in a row keeps the later
    ones' messages for them; what came while its receiver made no MPI call is taken by its
    first test, and the roll call's answers without a nap between them; a rank out of step
    raises."""
    job = run_mpi(4, [str(SCENARIOS / "transfers_objects.py")], timeout=120)
    assert job.returncode == 0, job.output
    for rank in range(4):
        assert re.search(rf"rank {rank}: \d+ objects whole", job.stdout), job.output
    for what, first in (("broadcast", (0, 1, 3)), ("gather", (0,))):
        took = {int(r): float(s) for r, s in
                re.findall(rf"rank (\d): flat {what} in ([\d.]+) s", job.stdout)}
        assert set(took) == {0, 1, 2, 3} and took[2] >= 3, job.output
        assert max(took[r] for r in first) < 1.5, job.output
    for rank, what in [(0, "gather"), *((r, "broadcast") for r in (1, 2, 3))]:
        assert f"rank {rank}: quiet {what}: first test True" in job.stdout, job.output
    assert re.search(r"rank 0: roll call: 0 naps: every rank answered rank 0's roll call \("
                     r"rank 0 waiting in  and ranks 1-3 waiting in the test\)", job.stdout), \
        job.output
    kept = re.search(r"rank 0: (\d+) messages kept for a later gather", job.stdout)
    assert kept and int(kept.group(1)) > 0, job.output
    assert re.search(r"rank 1: out of step: CommError: rank 0's message is of flat collective "
                     r"#\d+, not #\d+ \(a broadcast\): the ranks are out of step", job.stdout), \
        job.output


@pytest.mark.quick
def test_a_partner_stream_sends_each_window_once_it_has_landed(tmp_path):
    job = run_mpi(2, [str(SCENARIOS / "transfers_landing.py"), str(tmp_path)], timeout=120)
    assert job.returncode == 0, job.output
    for rank in (0, 1):
        assert f"rank {rank}: landed: the copy holds the landed bytes" in job.stdout, job.output
    assert "rank 0: failed: the failed landing reported" in job.stdout, job.output
    assert "rank 1: failed: received all" in job.stdout, job.output


@pytest.mark.quick
@pytest.mark.parametrize("n", [2, 3, 4])
def test_xor_parity_and_rebuilds_around_the_ring_are_the_xor_of_the_team(n):
    """local/xordirect.py and local/xorring.py on teams of 2 (a mirror), 3 and 4: every
    member's parity by direct transfers (over old bytes) and around the ring, then every
    member rebuilt in turn, in blocks that start at odd addresses, byte for byte numpy's."""
    job = run_mpi(n, [str(SCENARIOS / "transfers_xor_ring.py")], timeout=120)
    assert job.returncode == 0, job.output
    for rank in range(n):
        assert f"rank {rank}: direct ok" in job.stdout, job.output
        assert f"rank {rank}: ring ok" in job.stdout, job.output


def test_an_xor_rebuild_whose_lost_member_cannot_make_its_files_leaves_no_survivor_waiting(
        tmp_path):
    """The lost member takes the blocks into a scratch buffer and then raises; the survivors
    return at once rather than at the deadline (scenario transfers_xor_rebuild_fail.py)."""
    job = run_mpi(3, [str(SCENARIOS / "transfers_xor_rebuild_fail.py"), str(tmp_path)], timeout=120)
    assert job.returncode == 0, job.output
    assert re.search(r"rank 1: OSError No such file or directory after [0-9.]+ s", job.stdout), \
        job.output
    for rank in (0, 2):
        m = re.search(rf"rank {rank}: returned after ([0-9.]+) s", job.stdout)
        assert m and float(m.group(1)) < 10, job.output


@pytest.mark.parametrize("mode", ["hang", "stuck"])
def test_a_gated_partner_stream_ends_at_its_deadline(tmp_path, mode):
    """A peer that hangs, or bytes that never land: the stream ends with a CollectiveTimeout
    naming the phase within its 3 s deadline, and does not hang."""
    job = run_mpi(2, [str(SCENARIOS / "transfers_landing.py"), str(tmp_path), mode], timeout=120)
    took = re.findall(rf"rank (\d): {mode}: CollectiveTimeout after ([\d.]+) s: (.*)", job.stdout)
    ranks = {"hang": {"0"}, "stuck": {"0", "1"}}[mode]
    assert {r for r, _, _ in took} == ranks, job.output
    for rank, seconds, text in took:
        assert 2.5 <= float(seconds) <= 15, job.output
        assert "the partner exchange with rank" in text, job.output
        if mode == "stuck" and rank == "0":
            assert "its data was not ready within 3 s" in text, job.output
        else:
            assert "did not complete within 3 s" in text, job.output
    assert "without a deadline" not in job.stdout, job.output


def test_a_stream_whose_copy_has_no_room_waits_for_no_landing(tmp_path):
    """Rank 0 has no room for its copy of rank 1 and its bytes never land: its save fails, so
    its windows go at once; both streams end well before the deadline, rank 0's with the
    error, and nobody times out."""
    job = run_mpi(2, [str(SCENARIOS / "transfers_landing.py"), str(tmp_path), "stuck-full"],
                  timeout=120)
    ended = dict(re.findall(r"rank (\d): stuck-full: the stream ended without a deadline after "
                            r"[\d.]+ s, error: (.*)", job.stdout))
    assert set(ended) == {"0", "1"}, job.output
    assert "No space left on device" in ended["0"] and ended["1"] == "None", job.output
    assert "CollectiveTimeout" not in job.stdout, job.output


def test_a_partner_copy_too_short_to_map_fails_its_donor_and_never_hangs_its_receiver(tmp_path):
    """A truncated copy raised from the donor's memory map before any window went: the receiver
    waited for them (the job hung until the deadline, or MPI failed)."""
    job = run_mpi(2, [str(SCENARIOS / "transfers_short_copy.py"), str(tmp_path)], timeout=120)
    assert job.returncode == 0, job.output
    donor = (tmp_path / "rank-0.txt").read_text()
    assert donor.startswith("OSError") and "shorter than the 3145733 bytes expected" in donor
    assert str(tmp_path / "donor.h5") in donor
    assert (tmp_path / "rank-1.txt").read_text() == "ok 3145733"
