"""Hugging Face ``Trainer`` on mpickpt (mpickpt.hf): a 2-rank DDP job on CPU (gloo) under
mpiexec, through ``python -m mpickpt.run``. A rank SIGKILLed while writing a checkpoint: the
rerun resumes mid-epoch from the last committed one (the trainer state places the data) and
ends bit-identical to an uninterrupted run. A preemption signal: one emergency checkpoint, exit
code 3, and the rerun resumes there. The checkpoint of 2 ranks restores on 1."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from harness import SCENARIOS
from integrationkit import (
    assert_same,
    committed_steps,
    finals,
    killed_then_resumed,
    launch,
    preempted_then_resumed,
    report,
)

SCENARIO = str(SCENARIOS / "hf_train.py")
N = 2


train = partial(launch, ["-m", "mpickpt.run", SCENARIO])


@pytest.mark.slow
@pytest.mark.guarantee("no-torn-load", "resume-bit-identical")
def test_a_rank_killed_mid_save_resumes_mid_epoch_bit_identical(tmp_path: Path):
    """8 steps per epoch, a checkpoint every 6: killed writing step 12, resumed from step 6."""
    root, out, resumed = killed_then_resumed(
        train, N, tmp_path, ["--steps", "16", "--save-steps", "6"], "mid-write:1:kill:12", [6])
    assert "restored step 6" in resumed.stderr + resumed.stdout, resumed.output
    assert [report(out, r)["global_step"] for r in range(N)] == [16] * N
    assert committed_steps(root) == [6, 12, 16]  # the Trainer also saves its last step


@pytest.mark.slow
def test_a_preemption_signal_saves_once_exits_3_and_the_rerun_resumes_there(tmp_path: Path):
    _, out = preempted_then_resumed(train, N, tmp_path, ["--steps", "16", "--save-steps", "4"],
                                    signal_at=5, saved=4, within=range(5, 8))
    assert [report(out, r)["global_step"] for r in range(N)] == [16] * N


@pytest.mark.guarantee("reshard-bit-exact")
@pytest.mark.quick
def test_a_checkpoint_of_two_ranks_restores_on_one(tmp_path: Path):
    """8 steps on 2 ranks, then max_steps 8 on 1: the restore of step 8 ends training at once;
    the model is the one the 2 ranks saved, bit for bit."""
    root = tmp_path / "root"
    two = train(N, root, tmp_path / "two", "--steps", "8")
    assert two.returncode == 0, two.output
    one = train(1, root, tmp_path / "one", "--steps", "8")
    assert one.returncode == 0, one.output
    assert "restored step 8" in one.stderr + one.stdout, one.output
    got, want = finals(tmp_path / "one", 1)[0], finals(tmp_path / "two", N)[0]
    assert_same(got, want)


@pytest.mark.quick
def test_a_misconfigured_checkpointer_is_refused_as_train_starts(tmp_path: Path):
    """``keep=0`` (no checkpoint would be kept): ``train()`` fails on every rank as it starts,
    naming it, before a training step (the Checkpointer is made there, not at the first step's
    preemption check), and ROOT holds no checkpoint."""
    job = train(N, tmp_path / "root", tmp_path / "out", "--steps", "4", "--save-steps", "2",
                "--options", '{"keep": 0}')
    assert job.returncode != 0, job.output
    assert "keep must be at least 1, not 0" in job.output, job.output
    assert "trainer.train(" in job.output and "self.checkpointer" in job.output, job.output
    assert "_inner_training_loop" not in job.output, job.output  # (where the steps run)
    assert committed_steps(tmp_path / "root") == []
