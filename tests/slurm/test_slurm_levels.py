"""slurm/train.sbatch with the node-local level (MPICKPT_LOCAL) on a real one-node Slurm.

The job trains tests/scenarios/slurm_jobs.py on N ranks as tests/slurm/test_slurm_jobs.py does,
with a local level (one node: no redundancy) and ``--persist-every 1000``, so that the periodic
checkpoints stay on the node and only the emergency save (and the newest one at ``close()``)
reaches ROOT. ``scancel --signal=USR2`` preempts it: the emergency checkpoint must be drained to
ROOT before the job requeues itself, and the resumed run must end bit-identical to an
uninterrupted one:

* with the directory the template names after the job ("shm": /dev/shm/mpickpt-<jobid>), kept
  over the requeue (the same node comes back: the run resumes from the local level) and removed
  when the training finished;
* with a directory of the user's that is wiped while the job waits to be requeued (as if it came
  back on another node): the run resumes from ROOT, and the template never removes that path.

Each test takes about a minute (the requeue alone waits ~11 s on this Slurm).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import assert_same_final, step_dir
from test_slurm_jobs import Jobs, N, requeued_once, summaries, wait_for

STEPS = 60
PERSIST_EVERY = 1000  # never, in STEPS steps: only the emergency save and close() drain


class LocalJobs(Jobs):
    """Jobs whose script gets a local level's options (its directory comes from MPICKPT_LOCAL,
    which the template exports)."""

    def command(self, steps: int, sleep: float) -> list[str]:
        return [*super().command(steps, sleep), "--persist-every", str(PERSIST_EVERY)]


@pytest.fixture
def local_jobs(slurm, tmp_path: Path) -> Iterator[LocalJobs]:
    with LocalJobs(slurm, tmp_path) as j:
        yield j


def committed(root: Path) -> list[int]:
    """The steps committed in ``root`` (a ROOT, or a node's directory of the local level)."""
    return sorted(int(p.name[5:]) for p in root.glob("step-*")
                  if re.fullmatch(r"step-\d{8}", p.name) and (p / "MANIFEST.json").is_file())


def node_dirs(local: Path) -> list[Path]:
    """The nodes' directories of a local level (one here: the machine)."""
    return sorted(p for p in local.iterdir() if p.is_dir()) if local.is_dir() else []


def preempt_and_wait_for_requeue(slurm, jobs: LocalJobs, job: str) -> int:
    """Let ``job`` train 15 steps, preempt it with `scancel --signal=USR2` and wait until its
    first run has ended and the job waits to run again; the step it stopped at (rank 0)."""
    wait_for(lambda: len(jobs.progress()) >= 15, 180, f"job {job} to train 15 steps")
    slurm.cancel(job, "--signal=USR2")  # the ranks (steps) get it, not the batch shell
    wait_for(lambda: summaries(jobs.log("train", job)), 120, f"job {job}'s first run to end")
    [first] = summaries(jobs.log("train", job))
    assert (first["restart"], first["exit"], first["outcome"]) == (
        "0", "3", "preempted-requeued"), jobs.log("train", job)
    return jobs.last_step(job, 0, 0)


def check_drained(jobs: LocalJobs, step: int, log: str) -> None:
    """The emergency checkpoint of ``step``, and only it, is committed in ROOT, and the log says
    it was drained there."""
    assert (step_dir(jobs.root, step) / "MANIFEST.json").is_file(), (sorted(
        p.name for p in jobs.root.iterdir()), log)
    assert committed(jobs.root) == [step], (committed(jobs.root), log)
    assert f"drained step {step} to ROOT" in log, log
    assert f"checkpointing step {step} and exiting" in log, log
    if step % 10:
        assert f"INFO emergency checkpoint of step {step} committed" in log, log
        assert f"emergency checkpoint of step {step} committed on the nodes only" not in log, log


def preempted_after_a_local_save(slurm, jobs: LocalJobs, job: str, local: Path
                                 ) -> tuple[int, str]:
    """``job`` committed step 10 on its local level ``local`` and not in ROOT (a periodic
    checkpoint stays on the nodes); preempted, its emergency checkpoint was drained to ROOT
    (:func:`check_drained`). (The step it stopped at, its log.)"""
    wait_for(lambda: any(10 in committed(d) for d in node_dirs(local)), 180,
             f"job {job}'s checkpoint of step 10 on the local level {local}")
    assert committed(jobs.root) == [], "a periodic checkpoint reached ROOT"
    step = preempt_and_wait_for_requeue(slurm, jobs, job)
    log = jobs.log("train", job)
    check_drained(jobs, step, log)
    return step, log


def check_finished(slurm, jobs: LocalJobs, job: str, reference: Path) -> tuple[str, int]:
    """The job ended COMPLETED after one requeue, its second run resumed from the emergency
    checkpoint, and it ends bit-identical to ``reference``; (its log, the step resumed from)."""
    log, step = requeued_once(slurm, jobs, job)
    assert 15 <= step < STEPS
    assert f"drained step {STEPS} to ROOT" in log, log  # the newest one, at close()
    assert (jobs.root / "DONE").read_text().startswith(f"job={job} "), log
    assert_same_final(jobs.out, reference, N)
    return log, step


@pytest.mark.guarantee("resume-bit-identical")
def test_local_level_emergency_save_drained_to_root_requeue_resumes_bit_identical(
        slurm, local_jobs, reference_runs):
    """MPICKPT_LOCAL=shm: the job's own /dev/shm/mpickpt-<jobid>, kept over the requeue and
    removed once the training finished."""
    jobs = local_jobs
    reference = reference_runs[(N, STEPS)]
    job = jobs.train(["--time=10"], STEPS, sleep=0.2, MPICKPT_LOCAL="shm")
    local = Path(f"/dev/shm/mpickpt-{job}")
    try:
        step, log = preempted_after_a_local_save(slurm, jobs, job, local)
        assert f"local level: {local} (named after the job" in log, log
        assert f"local level {local} on 1 node(s), redundancy None" in log, log
        [node] = node_dirs(local)  # kept for the requeued run: the same node may come back
        assert step in committed(node), (committed(node), log)

        log, resumed = check_finished(slurm, jobs, job, reference)
        assert resumed == step
        assert f"restored step {step} from the local level" in log, log
        assert f"removed the local level {local}" in log, log
        assert not local.exists(), f"{local} was not removed at the end\n{log}"
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.guarantee("resume-bit-identical")
def test_local_level_wiped_before_the_requeued_run_resumes_from_root_bit_identical(
        slurm, local_jobs, reference_runs):
    """MPICKPT_LOCAL=<a path of the user's>, wiped while the job waits to run again (as if it
    came back on another node): the run resumes from the drained emergency checkpoint in ROOT;
    the template leaves the user's path alone at the end."""
    jobs = local_jobs
    reference = reference_runs[(N, STEPS)]
    local = jobs.tmp / "local"
    job = jobs.train(["--time=10"], STEPS, sleep=0.2, MPICKPT_LOCAL=str(local))
    step, log = preempted_after_a_local_save(slurm, jobs, job, local)
    assert f"local level: {local}\n" in log, log

    shutil.rmtree(local)  # the node is gone: the requeued run must not have started yet
    assert len(jobs.starts(0)) == 1, jobs.starts(0)
    assert slurm.state(job) != "RUNNING", slurm.show(job)

    log, resumed = check_finished(slurm, jobs, job, reference)
    assert resumed == step
    where = step_dir(jobs.root, step)
    assert re.search(rf"restored step {step} from \S*{re.escape(where.name)} ", log), log
    assert f"restored step {step} from the local level" not in log, log
    assert "removed the local level" not in log, log
    assert node_dirs(local), f"the template removed {local}, a path it did not name\n{log}"
