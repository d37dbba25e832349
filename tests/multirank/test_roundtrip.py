"""Round trips through real multi-rank jobs: every kind of value, and training resumed exactly."""

from __future__ import annotations

import json

import pytest
from harness import SCENARIOS, assert_same_final, run_mpi, train


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_kind_of_value_round_trips_bit_exact(tmp_path, n):
    job = run_mpi(n, [str(SCENARIOS / "roundtrip.py"), str(tmp_path / "ckpt")])
    assert job.returncode == 0, job.output
    assert job.stdout.count("round trip OK") == n, job.output


@pytest.mark.guarantee("resume-bit-identical")
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.quick), 4])
def test_resumed_training_matches_uninterrupted_run(tmp_path, n, reference_runs):
    root = tmp_path / "ckpt"
    first = train(n, root, 20, every=5)  # stops at step 20 with checkpoints 10, 15, 20
    assert first.returncode == 0, first.output
    resumed = train(n, root, 30, tmp_path / "out", every=5)
    assert resumed.returncode == 0, resumed.output
    for r in range(n):
        assert json.loads((tmp_path / "out" / f"rank-{r}.json").read_text())["start"] == 20
    assert_same_final(tmp_path / "out", reference_runs[(n, 30)], n)
