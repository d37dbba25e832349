"""How the save thread waits between real MPI ranks: the ranks that only learn a save's outcome,
once it is late, doze while nobody waits for it (scenario protocol_waits_outcome.py)."""

from __future__ import annotations

import re

import pytest
from harness import SCENARIOS, run_mpi


@pytest.mark.quick
def test_the_ranks_that_only_learn_a_late_outcome_doze_until_someone_waits(tmp_path):
    job = run_mpi(4, [str(SCENARIOS / "protocol_waits_outcome.py"), str(tmp_path / "root")],
                  timeout=120)
    assert job.returncode == 0, job.output
    seen = {(int(r), part): (int(s), int(w)) for r, part, s, w in re.findall(
        r"rank (\d): (\w+): slept (\d+) woken (\d+)", job.stdout)}
    assert len(seen) == 12, job.output
    for part in ("waited", "left", "loop"):  # rank 0 commits: it never dozes
        assert seen[0, part] == (0, 0), job.output
    for rank in (1, 2, 3):
        assert seen[rank, "waited"][0] == 0, job.output  # waited for: no nap slept out
        assert seen[rank, "left"][0] >= 2, job.output  # late, alone: it dozed, 50 ms a test
        assert seen[rank, "loop"][1] >= 1, job.output  # the next save, or ck.wait(), woke it
