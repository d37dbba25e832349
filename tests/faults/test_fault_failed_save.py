"""A save that fails on one rank aborts on every rank, training goes on, the next save commits and
the older checkpoints still restore."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from faultkit import committed_steps, losses, partials, reports, step_dirs
from harness import SCENARIOS, Job, assert_same_final, run_mpi, train

N = 2
pytestmark = pytest.mark.guarantee("failed-save-aborts")


@contextmanager
def counted(guarantees, case: str) -> Iterator[None]:
    """Count the case in the guarantee report (suite "disk") whether its checks pass or not."""
    try:
        yield
    except pytest.fail.Exception as e:
        guarantees.record("disk", case, "hang" if " hung for " in str(e) else "failed",
                          str(e)[:2000])
        raise
    except AssertionError as e:
        guarantees.record("disk", case, "failed", str(e)[:2000])
        raise
    guarantees.record("disk", case, "correct")


def failed_save(root: Path, mode: str, reports_dir: Path,
                env: dict[str, str] | None = None) -> tuple[Job, dict[int, dict]]:
    """Run tests/scenarios/fault_failed_save.py: saves 5, 10 (broken on rank 1 by ``mode``), 15."""
    job = run_mpi(N, [str(SCENARIOS / "fault_failed_save.py"), str(root), mode, str(reports_dir)],
                  env=env, timeout=90)
    assert job.returncode == 0, job.output
    found = reports(reports_dir)
    assert sorted(found) == list(range(N)), job.output
    return job, found


def check_failed_save(root: Path, job: Job, found: dict[int, dict], why: str,
                      alone: bool = True) -> None:
    """Step 10 aborted on every rank for ``why`` on rank 1 (``alone``: on rank 1 only)."""
    for r, rep in found.items():
        saves = rep["saves"]
        assert saves["5"]["committed"] and saves["15"]["committed"], rep
        failed = saves["10"]
        assert failed["committed"] is False and failed["path"] is None, rep
        assert "rank 1:" in failed["error"] and why in failed["error"], f"rank {r}: {failed}"
        assert not alone or "rank 0:" not in failed["error"], f"rank {r}: {failed}"
        assert rep["restored"] == [15, True, 5, True], f"rank {r}: {rep['restored']}"
        assert f"[mpickpt rank {r}] ERROR checkpoint of step 10 aborted on all ranks" \
            in job.stderr, job.output
    # right after the abort: no trace of step 10, the previous checkpoint untouched
    after = [name for name in found[0]["after_abort"] if name != "stats.jsonl"]
    assert after == ["step-00000005"], found[0]["after_abort"]
    assert committed_steps(root) == [5, 15], step_dirs(root)
    assert partials(root) == [], step_dirs(root)


@pytest.mark.quick
def test_injected_exception_mid_write_aborts_on_all_ranks(tmp_path, guarantees):
    root = tmp_path / "ckpt"
    with counted(guarantees, "exception mid-write on one rank"):
        job, found = failed_save(root, "raise", tmp_path / "reports",
                                 env={"MPICKPT_FAULT": "mid-write:1:raise:10"})
        check_failed_save(root, job, found,
                          "FaultInjected: injected fault at mid-write on rank 1")


def test_directory_in_place_of_shard_aborts_on_all_ranks(tmp_path, guarantees):
    root = tmp_path / "ckpt"
    with counted(guarantees, "a directory in place of one rank's shard"):
        check_failed_save(root, *failed_save(root, "dir", tmp_path / "reports"),
                          "rank-00001.h5")


def test_file_size_limit_aborts_on_all_ranks(tmp_path, guarantees):
    root = tmp_path / "ckpt"
    with counted(guarantees, "RLIMIT_FSIZE on one rank"):
        check_failed_save(root, *failed_save(root, "fsize", tmp_path / "reports"),
                          "[Errno 27] File too large: '")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 16 MiB tmpfs, or a skip where this process may not mount one."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_full_file_system_aborts_on_all_ranks(small_fs, tmp_path, guarantees):
    root = small_fs / "ckpt"
    with counted(guarantees, "file system full before the save"):
        # the file system is shared: rank 0 runs out of space too
        check_failed_save(root, *failed_save(root, "full", tmp_path / "reports"),
                          "No space left on device", alone=False)
        assert not (small_fs / "filler").exists()


def test_training_goes_on_unperturbed_after_a_failed_save(tmp_path, reference_runs):
    """examples/train.py with the save of step 15 failing on rank 1: the job finishes, step 20
    commits, and the final state is exactly that of a run without checkpoints."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    job = train(N, root, 20, out, every=5, keep=3, fault="mid-write:1:raise:15", timeout=90)
    assert job.returncode == 0, job.output
    for r in range(N):
        assert f"[mpickpt rank {r}] ERROR checkpoint of step 15 aborted on all ranks" \
            in job.stderr, job.output
    assert committed_steps(root) == [5, 10, 20], step_dirs(root)
    assert partials(root) == [], step_dirs(root)
    stats = [json.loads(line)["step"] for line in (root / "stats.jsonl").read_text().splitlines()]
    assert stats == [5, 10, 20]
    ref = reference_runs[(N, 20)]
    assert_same_final(out, ref, N)
    assert losses(out, N) == losses(ref, N)
