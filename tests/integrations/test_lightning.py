"""PyTorch Lightning on mpickpt (mpickpt.lightning): a 2-rank DDP job on CPU under mpiexec,
saving Lightning's whole checkpoint dict through mpickpt. A rank SIGKILLed while writing a
checkpoint: the rerun resumes from the last committed one and ends bit-identical to an
uninterrupted run. A preemption signal: one emergency checkpoint, exit code 3, and the rerun
resumes there. The checkpoint of 2 ranks restores on 1 (DDP's states are replicated)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("lightning")

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

SCENARIO = str(SCENARIOS / "lightning_train.py")
N = 2


train = partial(launch, [SCENARIO])


@pytest.mark.slow
@pytest.mark.guarantee("no-torn-load", "resume-bit-identical")
def test_a_rank_killed_mid_save_resumes_from_the_last_commit_bit_identical(tmp_path: Path):
    root, out, resumed = killed_then_resumed(train, N, tmp_path, ["--epochs", "4"],
                                             "mid-write:1:kill:12", [4, 8])
    assert [report(out, r)["resumed_from"] for r in range(N)] == [str(root)] * N
    assert "restored step 8" in resumed.stderr + resumed.stdout, resumed.output
    assert [report(out, r)["global_step"] for r in range(N)] == [16] * N
    assert committed_steps(root)[-1] == 16


@pytest.mark.slow
def test_a_preemption_signal_saves_once_exits_3_and_the_rerun_resumes_there(tmp_path: Path):
    """SIGUSR2 to rank 1 at step 10 (8 steps per epoch): every rank agrees within a step or two
    (a non-blocking vote), saves that step as the emergency checkpoint and exits 3."""
    step, out = preempted_then_resumed(train, N, tmp_path,
                                       ["--epochs", "4", "--batches", "8"], signal_at=10,
                                       saved=8, within=range(10, 16))
    assert all(report(out, r)["global_step"] > step for r in range(N))


@pytest.mark.guarantee("reshard-bit-exact")
@pytest.mark.quick
def test_a_checkpoint_of_two_ranks_restores_on_one(tmp_path: Path):
    """2 epochs on 2 ranks, then the same max_epochs on 1: fit restores step 8 and stops at
    once; the model is the one the 2 ranks saved, bit for bit."""
    root = tmp_path / "root"
    two = train(N, root, tmp_path / "two", "--epochs", "2")
    assert two.returncode == 0, two.output
    one = train(1, root, tmp_path / "one", "--epochs", "2")
    assert one.returncode == 0, one.output
    assert report(tmp_path / "one", 0)["global_step"] == 8
    got, want = finals(tmp_path / "one", 1)[0], finals(tmp_path / "two", N)[0]
    assert_same(got, want)


def test_fit_last_resumes_from_the_pointer_and_top_k_maps_onto_retention(tmp_path: Path):
    """ModelCheckpoint(monitor="train_loss", save_top_k=2) with MpickptIO(keep=1,
    best=("train_loss", "min"), keep_best=2): every pointer Lightning keeps names a committed
    step, the monitored value is in each manifest, and fit(ckpt_path="last") resumes from the
    step last.ckpt names."""
    root = tmp_path / "root"
    first = train(N, root, tmp_path / "first", "--epochs", "4", "--top-k", "2")
    assert first.returncode == 0, first.output
    kept = committed_steps(root)
    pointers = {p.name: json.loads(p.read_text())["step"]
                for p in (root / "lightning").glob("*.ckpt")}
    # last.ckpt and the top 2 (Lightning saves on improvement only, so last may be before 16)
    assert "last.ckpt" in pointers and len(pointers) == 3, pointers
    last = pointers["last.ckpt"]
    assert last == max(pointers.values()), pointers
    assert set(pointers.values()) <= set(kept), (pointers, kept)
    assert len(kept) <= 3, kept  # the newest and the 2 best by train_loss
    for s in kept:
        meta = json.loads((root / f"step-{s:08d}" / "MANIFEST.json").read_text())["metadata"]
        assert isinstance(meta["train_loss"], float) and meta["epoch"] == s // 4 - 1, meta
    out = tmp_path / "out"
    again = train(N, root, out, "--epochs", "5", "--top-k", "2", "--resume", "last")
    assert again.returncode == 0, again.output
    assert f"restored step {last}" in again.stderr + again.stdout, again.output
    assert [report(out, r)["resumed_from"] for r in range(N)] == ["last"] * N
    assert [report(out, r)["global_step"] for r in range(N)] == [20] * N


def test_lightnings_own_slurm_requeue_next_to_mpickpt_is_refused(tmp_path: Path):
    """Two handlers of one signal would each checkpoint and requeue: refused at setup, naming
    the fix (before anything is saved or any process group is made)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from mpickpt.lightning import DDPStrategy, MpickptIO

    strategy = DDPStrategy(checkpoint_io=MpickptIO(tmp_path / "root"),
                           cluster_environment=SLURMEnvironment(auto_requeue=True))
    with pytest.raises(ValueError, match=r"SLURMEnvironment\(auto_requeue=False\)"):
        strategy.setup(None)
    assert not (tmp_path / "root").exists()


@pytest.mark.quick
def test_a_misconfigured_checkpointer_is_refused_at_setup_before_a_step(tmp_path: Path):
    """``keep=0`` (no checkpoint would be kept): ``fit`` fails on every rank at setup (the
    Preemption callback's, or the strategy's), naming it, before a training step (the
    Checkpointer is made there, not at the first save), and ROOT holds no checkpoint."""
    job = train(N, tmp_path / "root", tmp_path / "out", "--epochs", "1", "--keep", "0")
    assert job.returncode != 0, job.output
    assert "keep must be at least 1, not 0" in job.output, job.output
    assert "in setup" in job.output, job.output
    assert "training_step" not in job.output and "save_checkpoint" not in job.output, job.output
    assert committed_steps(tmp_path / "root") == []


@pytest.mark.quick
def test_one_process_with_lightnings_own_strategy_makes_the_checkpointer_at_setup(
        tmp_path: Path):
    """MpickptIO as a plugin of one process, Lightning's own strategy: Preemption's setup makes
    the Checkpointer, so ``keep=0`` fails there before a step; with a good ``keep``, the job
    saves each epoch and a rerun resumes from the last one."""
    bad = train(1, tmp_path / "bad", tmp_path / "out0", "--epochs", "1", "--keep", "0",
                "--single")
    assert bad.returncode != 0, bad.output
    assert "keep must be at least 1, not 0" in bad.output, bad.output
    assert "in setup" in bad.output, bad.output
    assert "training_step" not in bad.output and "save_checkpoint" not in bad.output, \
        bad.output
    root = tmp_path / "root"
    first = train(1, root, tmp_path / "one", "--epochs", "2", "--single")
    assert first.returncode == 0, first.output
    assert committed_steps(root) == [4, 8]
    again = train(1, root, tmp_path / "two", "--epochs", "3", "--single")
    assert again.returncode == 0, again.output
    assert report(tmp_path / "two", 0)["resumed_from"] == str(root)
    assert report(tmp_path / "two", 0)["global_step"] == 12
    assert committed_steps(root)[-1] == 12
