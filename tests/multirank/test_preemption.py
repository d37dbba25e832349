"""Preemption: a SIGUSR2 to one rank makes every rank checkpoint the same step and exit with the
preempted code; the rerun resumes from that step and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import SCENARIOS, assert_same_final, mpiexec, python, train

from mpickpt.exitcodes import EXIT_PREEMPTED
from mpickpt.format import rootdir

N, STEPS = 4, 60


def start_job(root: Path, out: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"} | (extra or {})
    cmd = [*mpiexec(), "-n", str(N), *python(), str(SCENARIOS / "preemption_train.py"),
           str(root), str(out), str(STEPS)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def progress(out: Path, rank: int) -> int:
    p = out / f"progress-{rank}"
    lines = p.read_text().split() if p.exists() else []
    return int(lines[-1]) if lines else 0


@pytest.mark.guarantee("resume-bit-identical")
@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_to_one_rank_checkpoints_all_and_resume_is_bit_identical(
        tmp_path, reference_runs, sig):
    root, out1, out2 = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    job = start_job(root, out1)
    try:
        wait_for(lambda: progress(out1, 1) >= 15, 120, "rank 1 to pass step 15")
        os.kill(int((out1 / "pid-1").read_text()), sig)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_PREEMPTED, f"{stdout}\n{stderr}"
    last = [progress(out1, r) for r in range(N)]
    assert len(set(last)) == 1, f"ranks stopped at different steps: {last}"
    stopped = last[0]
    assert 15 <= stopped < STEPS
    what = "preemption signal" if sig == signal.SIGUSR2 else "SIGTERM"
    assert f"{what} on rank 1: checkpointing step {stopped}" in stderr, stderr
    steps = [s for s, _ in rootdir.committed(str(root))]
    assert steps[0] == stopped, (steps, stopped)
    assert not list(root.glob("*.partial-*"))

    job2 = train(N, root, STEPS, out2, every=10, keep=2)  # the rerun, through examples/train.py
    assert job2.returncode == 0, job2.output
    for r in range(N):
        assert json.loads((out2 / f"rank-{r}.json").read_text())["start"] == stopped
    assert_same_final(out2, reference_runs[(N, STEPS)], N)


@pytest.mark.quick
def test_no_emergency_save_when_the_deadline_leaves_no_time(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "first"
    job = start_job(root, out, {"MPICKPT_DEADLINE": str(time.time() - 1)})  # already past
    try:
        wait_for(lambda: progress(out, 0) >= 15, 120, "rank 0 to pass step 15")
        os.kill(int((out / "pid-2").read_text()), signal.SIGUSR2)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_PREEMPTED, f"{stdout}\n{stderr}"
    stopped = progress(out, 0)
    assert "no time for the emergency checkpoint of step" in stderr, stderr
    steps = [s for s, _ in rootdir.committed(str(root))]
    assert stopped not in steps and steps[0] == stopped // 10 * 10, (steps, stopped)
