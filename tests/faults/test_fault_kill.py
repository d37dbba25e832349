"""SIGKILL of one rank at each dangerous point of a save, in real MPI jobs.

The job must die (non-zero exit, no hang); a restarted job must restore the previous committed
step, never the torn one, clean up the dead run's partial directory, and end bit-identical to an
uninterrupted run. A rank that hangs instead makes the others miss a collective's deadline: the
job aborts with EXIT_COLLECTIVE_TIMEOUT and the previous checkpoint stays loadable.
"""

from __future__ import annotations

import pytest
from faultkit import committed_steps, losses, partials, reports, step_dirs
from harness import SCENARIOS, assert_same_final, run_mpi, starts, step_dir, train

from mpickpt.exitcodes import EXIT_COLLECTIVE_TIMEOUT

STEPS, EVERY, KILLED = 20, 5, 15


@pytest.mark.guarantee("no-torn-load", "resume-bit-identical")
@pytest.mark.parametrize(
    ("n", "fault"),
    [
        (2, "mid-write:0:kill"),
        pytest.param(2, "mid-write:1:kill", marks=pytest.mark.quick),
        (4, "mid-write:2:kill"),
        (2, "after-fsync-before-vote:1:kill"),
        (2, "after-vote-before-manifest:0:kill"),
        (2, "mid-manifest-write:0:kill"),
    ],
    ids=["mid-write-rank0", "mid-write-rank1", "mid-write-rank2-of-4",
         "after-fsync-before-vote-rank1", "after-vote-before-manifest-rank0",
         "mid-manifest-write-rank0"],
)
def test_kill_during_save_restores_previous_checkpoint(tmp_path, reference_runs, n, fault):
    root, out = tmp_path / "ckpt", tmp_path / "out"

    dead = train(n, root, STEPS, every=EVERY, fault=f"{fault}:{KILLED}", timeout=90)
    assert dead.returncode != 0, f"the job survived a SIGKILL of one rank\n{dead.output}"
    assert f"checkpoint step {KILLED} committed" not in dead.stderr, dead.output
    # the torn step exists only as the dead run's partial directory, never as a checkpoint
    assert not step_dir(root, KILLED).exists(), step_dirs(root)
    assert committed_steps(root) == [5, 10], step_dirs(root)
    left = partials(root, KILLED)
    assert len(left) == 1, step_dirs(root)
    if fault.startswith("mid-manifest-write"):  # the half-written manifest is a temp file
        assert not (left[0] / "MANIFEST.json").exists()
        assert list(left[0].glob("MANIFEST.json.tmp-*")), list(left[0].iterdir())

    resumed = train(n, root, STEPS, out, every=EVERY, timeout=90)
    assert resumed.returncode == 0, resumed.output
    assert starts(out, n) == [10] * n, resumed.output
    assert "restored step 10 from" in resumed.stderr, resumed.output
    assert f"removing {left[0]}, left by an earlier run" in resumed.stderr, resumed.output
    assert not left[0].exists()
    assert partials(root) == [], step_dirs(root)
    assert committed_steps(root) == [10, 15, 20], step_dirs(root)

    ref = reference_runs[(n, STEPS)]
    assert_same_final(out, ref, n)
    assert losses(out, n) == losses(ref, n)


@pytest.mark.guarantee("no-hang", "no-torn-load")
@pytest.mark.parametrize(
    ("fault", "waiting_rank", "phase", "missing"),
    [("mid-write:1:hang:10", 0, "vote",
      "did not arrive: rank 1, last seen in phase 'commit' (collective #"),
     ("after-vote-before-manifest:0:hang:10", 1, "commit",
      "rank 0 did not answer within 5 s, so rank 0 did not arrive (last seen in phase 'commit' "
      "(collective #")],
    ids=["rank1-hangs-mid-write", "rank0-hangs-before-manifest"],
)
def test_hang_during_save_aborts_job_at_deadline(tmp_path, fault, waiting_rank, phase, missing):
    root = tmp_path / "ckpt"
    deadline = 3
    hung = run_mpi(2, [str(SCENARIOS / "save_hang.py"), str(root), "15", str(deadline)],
                   env={"MPICKPT_FAULT": fault}, timeout=60)
    assert hung.returncode == EXIT_COLLECTIVE_TIMEOUT, hung.output
    assert "finished" not in hung.stdout, hung.output
    # the surviving rank names the one that did not arrive and where it was last seen
    assert (f"[mpickpt rank {waiting_rank}] ERROR rank {waiting_rank}: the other ranks did not "
            f"all reach phase {phase!r} within {deadline} s; {missing}") in hung.stderr, hung.output
    assert committed_steps(root) == [5], step_dirs(root)
    left = partials(root, 10)
    assert len(left) == 1, step_dirs(root)

    probe = run_mpi(2, [str(SCENARIOS / "fault_restore.py"), str(root), str(tmp_path / "rep")],
                    timeout=60)
    assert probe.returncode == 0, probe.output
    found = reports(tmp_path / "rep")
    assert [(r["step"], r["skipped"]) for r in found.values()] == [(5, [])] * 2, found
    assert not left[0].exists(), step_dirs(root)
