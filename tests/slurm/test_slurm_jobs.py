"""The slurm/ templates on a real one-node Slurm (the `slurm` fixture, tests/slurm/conftest.py).

Every test submits the templates exactly as the README's "Running on Slurm" section says and
trains tests/scenarios/slurm_jobs.py (examples/train.py's job, slowed down) on N ranks with srun
and the pip MPICH (--mpi=pmi2):

* a time limit: `--time=2 --signal=B:USR2@40` makes Slurm signal the batch shell, which forwards
  SIGUSR2 to the ranks; they checkpoint, the job requeues itself, runs again, resumes and finishes;
* `scancel --signal=USR2 JOB` (which reaches the ranks only) does the same;
* a job killed with `scancel -s KILL` (the job: Slurm SIGTERMs it first, the ranks save; or its
  step: every rank dies at once) comes back through slurm/submit's restart-on-failure watcher;
* failures beyond MPICKPT_MAX_FAILURES are not resubmitted.

Each resumed run must end bit-identical to an uninterrupted run. Slurm checks time limits and
--signal only every 30 s and requeues after ~11 s, so these tests take minutes, not seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import assert_same_final, mpiexec

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "slurm"
SCENARIO = REPO / "tests" / "scenarios" / "slurm_jobs.py"
N = 2  # ranks; the node has CPUs=8, the machine may have 2 cores


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def summaries(log: str) -> list[dict[str, str]]:
    """The `mpickpt-train: summary: k=v ...` line of every run, in order."""
    return [dict(re.findall(r"(\w+)=(\S+)", line.split("summary:", 1)[1]))
            for line in log.splitlines() if line.startswith("mpickpt-train: summary:")]


class Jobs:
    """One test's jobs: named NAME-train / NAME-watch, all cancelled when the test ends."""

    def __init__(self, slurm, tmp: Path) -> None:
        self.slurm = slurm
        self.tmp = tmp
        self.name = f"mpickpt-{uuid.uuid4().hex[:8]}"
        self.root, self.out, self.logs = tmp / "ckpt", tmp / "out", tmp / "logs"
        self.logs.mkdir()

    def __enter__(self) -> Jobs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel_all()

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "MPICKPT_"))}
        env.update(MPICKPT_ROOT=str(self.root), MPICKPT_PYTHON=sys.executable,
                   PYTHONUNBUFFERED="1", **extra)
        return env

    def command(self, steps: int, sleep: float) -> list[str]:
        return [str(SCENARIO), str(self.root), str(self.out), str(steps), "--sleep", str(sleep),
                "--every", "10"]

    def options(self, extra: list[str]) -> list[str]:
        return ["-J", f"{self.name}-train", "-n", str(N),
                "-o", str(self.logs / "train-%j.out"), *extra]

    def _run(self, cmd: list[str], env: dict[str, str]) -> str:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=self.tmp,
                           timeout=60)
        assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout}{p.stderr}"
        return p.stdout.strip()

    def train(self, extra: list[str], steps: int, sleep: float, **env: str) -> str:
        """sbatch [options] slurm/train.sbatch slurm_jobs.py ...; the job id."""
        out = self._run(["sbatch", "--parsable", *self.options(extra),
                         str(SLURM_DIR / "train.sbatch"), *self.command(steps, sleep)],
                        self.env(**env))
        return out.split(";")[0]

    def submit(self, extra: list[str], steps: int, sleep: float, **env: str
               ) -> tuple[str, str]:
        """slurm/submit [options] -- slurm_jobs.py ...; (training job id, watcher job id)."""
        watch = f"-J {self.name}-watch -o {self.logs / 'watch-%j.out'}"
        out = self._run([str(SLURM_DIR / "submit"), *self.options(extra), "--",
                         *self.command(steps, sleep)],
                        self.env(MPICKPT_WATCHER_ARGS=watch, **env))
        m = re.fullmatch(r"train=(\d+) watcher=(\d+)", out)
        assert m, out
        return m.group(1), m.group(2)

    def log(self, kind: str, job: str) -> str:
        p = self.logs / f"{kind}-{job}.out"
        return p.read_text() if p.exists() else f"(no {p})"

    def progress(self, rank: int = 0) -> list[tuple[int, str, int]]:
        """(step, job, restart) of every finished step of this rank, over all runs."""
        p = self.out / f"progress-{rank}"
        lines = p.read_text().splitlines() if p.exists() else []
        return [(int(s), j, int(r)) for s, j, r in (ln.split() for ln in lines if ln.strip())]

    def starts(self, rank: int) -> list[tuple[str, int, int]]:
        """(job, restart, resumed-from step) of every run of this rank."""
        p = self.out / f"starts-{rank}"
        lines = p.read_text().splitlines() if p.exists() else []
        return [(j, int(r), int(s)) for j, r, s in (ln.split() for ln in lines if ln.strip())]

    def last_step(self, job: str, restart: int, rank: int) -> int:
        """The last step that run (job, restart) of ``rank`` finished."""
        steps = [s for s, j, r in self.progress(rank) if j == job and r == restart]
        assert steps, f"rank {rank}: no progress of job {job} run {restart}"
        return steps[-1]

    def alive(self) -> list[str]:
        """This test's jobs that Slurm still has pending or running."""
        p = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True,
                           timeout=30)
        return [ln for ln in p.stdout.splitlines()
                if len(ln.split()) == 3 and ln.split()[1].startswith(self.name)]

    def cancel_all(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "STOP").touch()  # a watcher that still starts resubmits nothing
        for line in self.alive():  # and a job that would requeue itself on SIGTERM cannot
            subprocess.run(["scontrol", "update", f"JobId={line.split()[0]}", "Requeue=0"],
                           capture_output=True, timeout=30)
        for kind in ("watch", "train"):
            subprocess.run(["scancel", "-n", f"{self.name}-{kind}"], capture_output=True,
                           timeout=30)
        end = time.monotonic() + 60
        while self.alive() and time.monotonic() < end:
            time.sleep(0.5)


@pytest.fixture
def jobs(slurm, tmp_path: Path) -> Iterator[Jobs]:
    with Jobs(slurm, tmp_path) as j:
        yield j


def requeued_once(slurm, jobs: Jobs, job: str) -> tuple[str, int]:
    """``job`` ended COMPLETED after one requeue (its first run preempted and requeued, its
    second finished) and its second run resumed from its first's emergency checkpoint on every
    rank; (its log, the step resumed from)."""
    state = slurm.wait(job, timeout=240)
    log = jobs.log("train", job)
    assert state == "COMPLETED", f"job {job} ended {state}\n{log}"
    runs = summaries(log)
    assert [(s["restart"], s["exit"], s["outcome"]) for s in runs] == [
        ("0", "3", "preempted-requeued"), ("1", "0", "finished")], log
    assert int(slurm.show(job)["Restarts"]) == 1
    [step] = check_resumed_runs(jobs, job, 2)
    return log, step


def check_resumed_runs(jobs: Jobs, job: str, runs: int) -> list[int]:
    """Run 0 of ``job`` started fresh and every later run resumed, on every rank, from the step
    its predecessor stopped at (its emergency checkpoint); the steps resumed from."""
    resumed = []
    for r in range(N):
        starts = jobs.starts(r)
        assert [(j, k) for j, k, _ in starts] == [(job, k) for k in range(runs)], starts
        assert starts[0][2] == 0, starts
        for k in range(1, runs):
            assert starts[k][2] == jobs.last_step(job, k - 1, r) > 0, (r, starts)
        resumed.append([s for _, _, s in starts])
    assert all(x == resumed[0] for x in resumed), f"ranks resumed differently: {resumed}"
    return resumed[0][1:]


@pytest.mark.guarantee("resume-bit-identical")
def test_time_limit_signal_checkpoints_requeues_and_resumes_bit_identical(
        slurm, jobs, reference_runs):
    steps = 150  # ~0.6 s a step: ~90 s, longer than the 50..80 s before the signal comes (130
    # steps once ended in 77 s, before it); the second run's at most 70 steps end before its
    # signal unless the machine is loaded (see below)
    reference = reference_runs[(N, steps)]
    job = jobs.train(["--time=2", "--signal=B:USR2@40"], steps, sleep=0.5)
    state = slurm.wait(job, timeout=480)
    log = jobs.log("train", job)
    assert state == "COMPLETED", f"job {job} ended {state}\n{log}"
    runs = summaries(log)
    assert len(runs) >= 2, log
    assert [s["outcome"] for s in runs] == ["preempted-requeued"] * (len(runs) - 1) + ["finished"]
    assert [int(s["restart"]) for s in runs] == list(range(len(runs))), log
    assert [s["exit"] for s in runs] == ["3"] * (len(runs) - 1) + ["0"], log
    # each preempted run got the signal once; the last one may get its own too (Slurm sends it
    # up to a minute early, and a loaded machine slows the run), but only once it has trained
    # and saved the last step: then it has nothing to checkpoint and ends as finished
    forwarded = "got SIGUSR2: forwarding it to the ranks"
    each = re.split(r"(?m)^(?=mpickpt-train: start:)", log)[1:]
    assert len(each) == len(runs), log
    assert [e.count(forwarded) for e in each[:-1]] == [1] * (len(runs) - 1), log
    if forwarded in each[-1]:
        assert each[-1].count(forwarded) == 1, log
        assert each[-1].index(forwarded) > each[-1].index(f"checkpoint step {steps} committed")
        assert "and exiting" not in each[-1], log
    assert "DUE TO TIME LIMIT" not in log, log
    assert int(slurm.show(job)["Restarts"]) == len(runs) - 1
    for step in check_resumed_runs(jobs, job, len(runs)):
        assert f"checkpointing step {step} and exiting" in log, log
        assert f"restored step {step} from" in log, log
    assert (jobs.root / "DONE").read_text().startswith(f"job={job} "), log
    assert_same_final(jobs.out, reference, N)


@pytest.mark.guarantee("resume-bit-identical")
def test_scancel_usr2_preempts_requeues_and_resumes_bit_identical(slurm, jobs, reference_runs):
    steps = 60
    reference = reference_runs[(N, steps)]
    job = jobs.train(["--time=10"], steps, sleep=0.2)
    wait_for(lambda: len(jobs.progress()) >= 15, 180, f"job {job} to train 15 steps")
    slurm.cancel(job, "--signal=USR2")  # the ranks (steps) get it, not the batch shell
    log, step = requeued_once(slurm, jobs, job)
    assert 15 <= step < steps
    assert f"checkpointing step {step} and exiting" in log, log
    if step % 10:
        assert f"INFO emergency checkpoint of step {step} committed" in log, log
    assert_same_final(jobs.out, reference, N)


@pytest.mark.guarantee("resume-bit-identical")
def test_mpich_mpiexec_launcher_and_an_early_signal_held_until_the_ranks_are_up(
        slurm, jobs, reference_runs):
    """MPICKPT_LAUNCHER=mpiexec (MPICH's hydra here, as a system MPI's own launcher would be):
    the batch shell's SIGUSR2, which came before the ranks could handle it, is held until rank 0
    says every rank is ready (MPICKPT_READY_FILE), then passed on (as SIGTERM: hydra dies of
    SIGUSR2). MPICKPT_HOLD_S, the limit of the hold, is far beyond this job's length: the
    handshake, not the limit, ends the hold (a fixed 15 s once let a rank that was still
    starting on a loaded machine die of the SIGTERM)."""
    steps = 100
    reference = reference_runs[(N, steps)]
    launcher, *flags = mpiexec()
    job = jobs.train(["--time=10"], steps, sleep=0.2, MPICKPT_LAUNCHER=launcher,
                     MPICKPT_MPIRUN_ARGS=" ".join(flags), MPICKPT_HOLD_S="600")
    wait_for(lambda: slurm.state(job) == "RUNNING", 60, f"job {job} to start")
    # RUNNING comes before the batch shell has its trap: a signal then kills the shell itself
    # (seen once: the job ended FAILED by signal 12 with an empty log). The template's first
    # line is printed after the trap is set; the ranks are not up yet, which is the point.
    wait_for(lambda: "mpickpt-train: start" in jobs.log("train", job), 60,
             f"job {job}'s batch shell to start")
    slurm.cancel(job, "-b", "--signal=USR2")  # the batch shell only, as --signal=B:USR2 does
    state = slurm.wait(job, timeout=240)
    log = jobs.log("train", job)
    assert state == "COMPLETED", f"job {job} ended {state}\n{log}"
    assert re.search(r"got SIGUSR2 \d+s after the launch, before the ranks are ready: holding "
                     r"it until they are \(at most \d+s\)", log), log
    assert "the ranks are ready" in log, log
    assert "got SIGUSR2: forwarding it to the ranks" in log, log
    runs = summaries(log)
    assert [(s["restart"], s["exit"], s["outcome"]) for s in runs] == [
        ("0", "3", "preempted-requeued"), ("1", "0", "finished")], log
    [step] = check_resumed_runs(jobs, job, 2)
    assert 0 < step < steps
    assert_same_final(jobs.out, reference, N)


@pytest.mark.guarantee("resume-bit-identical")
@pytest.mark.parametrize("target", ["job", "step"])
def test_hard_kill_is_restarted_by_the_watcher_and_ends_bit_identical(
        slurm, jobs, reference_runs, target):
    steps = 60
    reference = reference_runs[(N, steps)]
    train, watcher = jobs.submit(["--time=10"], steps, sleep=0.2)
    wait_for(lambda: (jobs.root / "step-00000020").is_dir(), 180, "checkpoint step 20")
    # `scancel -s KILL J`: Slurm ends the job as scancel does (SIGTERM, SIGKILL KillWait=10 s
    # later): the ranks save and exit 3; the job is CANCELLED, not requeued.
    # `scancel -s KILL J.0`: SIGKILL to every rank at once; the batch script fails (137).
    slurm.cancel(train if target == "job" else f"{train}.0", "-s", "KILL")
    assert slurm.wait(train, timeout=60) == ("CANCELLED" if target == "job" else "FAILED")
    assert slurm.show(train).get("Restarts", "0") == "0", "a cancelled job was requeued"
    killed_at = [jobs.last_step(train, 0, r) for r in range(N)]
    assert slurm.wait(watcher, timeout=120) == "COMPLETED", jobs.log("watch", watcher)
    wlog = jobs.log("watch", watcher)
    m = re.search(r"resubmitted from step (\d+): train=(\d+) watcher=(\d+)", wlog)
    assert m, wlog
    step, train2, watcher2 = int(m.group(1)), m.group(2), m.group(3)
    assert "failure 1 (at most 3 are resubmitted)" in wlog, wlog
    if target == "job":  # the emergency checkpoint of the step the ranks were at
        assert killed_at == [step] * N, (killed_at, step, jobs.log("train", train))
    else:  # the newest periodic checkpoint
        assert step % 10 == 0 and 20 <= step <= min(killed_at), (killed_at, step)
    assert slurm.wait(train2, timeout=240) == "COMPLETED", jobs.log("train", train2)
    assert slurm.wait(watcher2, timeout=120) == "COMPLETED", jobs.log("watch", watcher2)
    assert "the training finished" in jobs.log("watch", watcher2)
    for r in range(N):
        assert jobs.starts(r) == [(train, 0, 0), (train2, 0, step)], jobs.starts(r)
    assert (jobs.root / "FAILURES").read_text().strip() == "1"
    assert not jobs.alive()
    assert_same_final(jobs.out, reference, N)


def test_failures_beyond_the_cap_are_not_resubmitted(slurm, jobs):
    train, watcher = jobs.submit(["--time=10"], 400, sleep=0.2, MPICKPT_MAX_FAILURES="1")
    wait_for(lambda: (jobs.root / "step-00000010").is_dir(), 180, "checkpoint step 10")
    slurm.cancel(f"{train}.0", "-s", "KILL")
    assert slurm.wait(watcher, timeout=120) == "COMPLETED", jobs.log("watch", watcher)
    m = re.search(r"resubmitted from step \d+: train=(\d+) watcher=(\d+)",
                  jobs.log("watch", watcher))
    assert m, jobs.log("watch", watcher)
    train2, watcher2 = m.groups()
    wait_for(lambda: any(j == train2 for _, j, _ in jobs.progress()), 180,
             f"the resubmitted job {train2} to train")
    slurm.cancel(f"{train2}.0", "-s", "KILL")
    assert slurm.wait(train2, timeout=60) == "FAILED"
    assert slurm.wait(watcher2, timeout=120) == "FAILED", jobs.log("watch", watcher2)
    wlog = jobs.log("watch", watcher2)
    assert (f"failure 2 of training job {train2} exceeds MPICKPT_MAX_FAILURES=1: giving up"
            in wlog), wlog
    assert "resubmitted from step" not in wlog, wlog
    assert (jobs.root / "FAILURES").read_text().strip() == "2"
    time.sleep(3)  # two scheduler passes: a job submitted by the watcher would show by now
    assert not jobs.alive(), jobs.alive()


def test_scancel_ends_a_job_that_runs_mpickpt_without_the_template(slurm, jobs):
    """`srun python -m mpickpt.run ...` in a batch script of one's own (--requeue): `scancel`
    must end the job. slurm/train.sbatch is not affected: it keeps the ranks from requeueing
    (MPICKPT_REQUEUE=0) and requeues only a job still RUNNING."""
    cmd = " ".join([sys.executable, "-m", "mpickpt.run", *jobs.command(400, 0.2)])
    out = jobs._run(["sbatch", "--parsable", *jobs.options(["--requeue", "--open-mode=append"]),
                     "--wrap", f"srun --mpi=pmi2 -K1 {cmd}"], jobs.env())
    job = out.split(";")[0]
    wait_for(lambda: len(jobs.progress()) >= 5, 180, f"job {job} to train 5 steps")
    slurm.cancel(job)
    wait_for(lambda: slurm.state(job) not in ("RUNNING", "COMPLETING", "CONFIGURING"), 60,
             f"job {job} to end")
    time.sleep(1)
    state, restarts = slurm.state(job), slurm.show(job).get("Restarts")
    assert (state, restarts) == ("CANCELLED", "0"), jobs.log("train", job)
