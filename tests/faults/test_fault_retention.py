"""Retention: ``keep=N`` leaves exactly the N newest checkpoints, and deletes old ones only after a
newer one has committed, so a crash in the middle of a save never takes the last good one."""

from __future__ import annotations

import json

import pytest
from faultkit import committed_steps, losses, partials, step_dirs
from harness import assert_same_final, starts, train

N = 2
pytestmark = pytest.mark.guarantee("retention-after-commit")


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_n_leaves_exactly_the_n_newest(tmp_path, keep):
    root = tmp_path / "ckpt"
    job = train(N, root, 40, every=5, keep=keep, timeout=90)
    assert job.returncode == 0, job.output
    saved = [json.loads(line)["step"] for line in (root / "stats.jsonl").read_text().splitlines()]
    assert saved == [5, 10, 15, 20, 25, 30, 35, 40]  # eight saves, all committed
    newest = saved[-keep:]
    assert committed_steps(root) == newest, step_dirs(root)
    # nothing else: no partial, half-deleted or manifest-less step directories
    assert step_dirs(root) == [f"step-{s:08d}" for s in newest]
    for step in saved[:-keep]:
        assert f"retention (keep={keep}): removing step {step}" in job.stderr, job.output


def test_kill_mid_save_with_keep_1_keeps_the_last_good_checkpoint(tmp_path, reference_runs):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    dead = train(N, root, 20, every=5, keep=1, fault="mid-write:1:kill:15", timeout=90)
    assert dead.returncode != 0, dead.output
    assert committed_steps(root) == [10], step_dirs(root)
    assert len(partials(root, 15)) == 1, step_dirs(root)

    resumed = train(N, root, 20, out, every=5, keep=1, timeout=90)
    assert resumed.returncode == 0, resumed.output
    assert starts(out, N) == [10] * N, resumed.output
    assert step_dirs(root) == ["step-00000020"]
    ref = reference_runs[(N, 20)]
    assert_same_final(out, ref, N)
    assert losses(out, N) == losses(ref, N)


@pytest.mark.quick
def test_kill_between_commit_and_retention_keeps_both(tmp_path, reference_runs):
    """Rank 0 dies after step 15 committed but before retention removed step 10: both remain,
    the restart loads 15 and its own retention then removes the surplus."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    dead = train(N, root, 20, every=5, keep=1, fault="after-commit-before-retention:0:kill:15",
                 timeout=90)
    assert dead.returncode != 0, dead.output
    assert committed_steps(root) == [10, 15], step_dirs(root)
    # saves are asynchronous: rank 1 may have started writing step 20 before the job died
    assert set(step_dirs(root)) - {"step-00000010", "step-00000015"} \
        == {p.name for p in partials(root, 20)}, step_dirs(root)

    resumed = train(N, root, 20, out, every=5, keep=1, timeout=90)
    assert resumed.returncode == 0, resumed.output
    assert starts(out, N) == [15] * N, resumed.output
    assert step_dirs(root) == ["step-00000020"]  # the surplus and any partial are gone
    ref = reference_runs[(N, 20)]
    assert_same_final(out, ref, N)
    assert losses(out, N) == losses(ref, N)
