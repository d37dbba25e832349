"""mpickpt.slurm: what comes from Slurm, driven by the environment it is given."""

from __future__ import annotations

import logging
import os

import pytest

from mpickpt import slurm


def test_the_job_end_is_mpickpts_deadline_else_slurms():
    assert slurm.job_end({}) is None
    assert slurm.job_end({"SLURM_JOB_END_TIME": "1700000000"}) == 1700000000.0
    assert slurm.job_end({"SLURM_JOB_END_TIME": "1700000000", "MPICKPT_DEADLINE": "5.5"}) == 5.5
    with pytest.raises(ValueError, match="MPICKPT_DEADLINE='soon'"):
        slurm.job_end({"MPICKPT_DEADLINE": "soon"})


def test_a_job_requeues_itself_under_slurm_unless_told_not_to():
    assert not slurm.requeues({})
    assert slurm.requeues({"SLURM_JOB_ID": "42"})
    assert not slurm.requeues({"SLURM_JOB_ID": "42", "MPICKPT_REQUEUE": "0"})


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A real `scontrol` on PATH that records its arguments, and exits with $SCONTROL_EXIT."""
    calls = tmp_path / "calls"
    exe = tmp_path / "bin" / "scontrol"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "no such job" >&2\n'
                   'exit "${SCONTROL_EXIT:-0}"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_requeue_runs_scontrol_requeue_for_the_job(scontrol, caplog):
    caplog.set_level(logging.INFO)
    log = logging.getLogger("test-slurm")
    assert not slurm.requeue(log, {})  # not under Slurm: nothing to requeue
    assert not scontrol.exists()
    assert slurm.requeue(log, {"SLURM_JOB_ID": "42"})
    assert scontrol.read_text() == "requeue 42\n"
    assert "requeued Slurm job 42" in caplog.text


def test_a_failed_requeue_is_logged_with_scontrols_words(scontrol, caplog, monkeypatch):
    monkeypatch.setenv("SCONTROL_EXIT", "1")
    assert not slurm.requeue(logging.getLogger("test-slurm"), {"SLURM_JOB_ID": "7"})
    assert "scontrol requeue 7 failed (exit 1): no such job" in caplog.text


def test_requeue_without_scontrol_says_so_and_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol there
    assert not slurm.requeue(logging.getLogger("test-slurm"), {"SLURM_JOB_ID": "9"})
    assert "cannot run scontrol requeue 9" in caplog.text
