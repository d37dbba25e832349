"""mpickpt-restore --prune: the Checkpointer's retention policy, on the saves of a real job.

examples/train.py (2 ranks) checkpoints every 5 steps up to 40 and keeps them all; each manifest
holds the training loss of its step in the user metadata. The expected outcome is worked out here
from those manifests, independently of mpickpt.save.retention.
"""

from __future__ import annotations

import shutil

import pytest
from clikit import cli, cli_json
from harness import manifest, step_dir, train

from mpickpt.cli import EXIT_OK

STEPS = list(range(5, 41, 5))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune") / "ckpt"
    job = train(2, root, 40, every=5, keep=100, timeout=150)
    assert job.returncode == 0, job.output
    loss = {s: manifest(root, s)["metadata"]["loss"] for s in STEPS}
    assert all(isinstance(v, float) for v in loss.values())
    return root, loss


@pytest.fixture
def root(saved, tmp_path):
    return shutil.copytree(saved[0], tmp_path / "ckpt")


def present(root) -> list[int]:
    return [s for s in STEPS if step_dir(root, s).exists()]


@pytest.mark.quick
def test_keep_every_and_best_with_the_reason_for_each(root, saved):
    loss = saved[1]
    worst = max(loss, key=lambda s: (loss[s], s))
    code, doc = cli_json(root, "--prune", "--keep", "2", "--keep-every", "20",
                         "--best", "loss:max", "--keep-best", "1", restore=True)
    assert code == EXIT_OK
    want = {40, 35, 20, worst}
    assert present(root) == sorted(want)
    assert sorted(a["step"] for a in doc["actions"]) == sorted(set(STEPS) - want)
    assert all(a["action"] == "delete" and a["done"] for a in doc["actions"])
    ret = doc["retention"]
    assert ret["policy"] == "--keep 2 --keep-every 20 --best loss:max --keep-best 1"
    why = {k["step"]: k["why"] for k in ret["kept"]}
    assert list(why) == sorted(want, reverse=True)
    assert why[40].startswith("newest") and "every 20" in why[40]
    assert "newest 2" in why[35] and "every 20" in why[20]
    assert "best 1 by loss (max)" in why[worst]
    assert ret["deleted"] == sorted(set(STEPS) - want, reverse=True) and ret["unranked"] == []


def test_best_by_min_and_the_human_report(root, saved):
    loss = saved[1]
    best2 = sorted(loss, key=lambda s: (loss[s], -s))[:2]
    code, out, err = cli(root, "--prune", "--keep", "1", "--best", "loss",
                         "--keep-best", "2", "--dry-run", restore=True)
    assert code == EXIT_OK, err
    assert "kept by the retention policy (--keep 1 --best loss:min --keep-best 2):" in out
    assert "  step 40         newest" in out
    for s in best2:
        assert f"  step {s:<10} " in out and "best 2 by loss (min)" in out
    assert present(root) == STEPS  # a dry run
    assert out.count("would delete") == len(set(STEPS) - {40, *best2})


def test_the_newest_is_never_deleted_and_unranked_ones_are_said(root):
    code, doc = cli_json(root, "--prune", "--keep", "1", "--best", "val_loss:min",
                         "--keep-best", "3", restore=True)
    assert code == EXIT_OK and present(root) == [40]
    assert doc["retention"]["unranked"] == sorted(STEPS, reverse=True)
    assert doc["retention"]["kept"] == [{"step": 40, "why": "newest"}]


def test_after_a_rollback_the_policy_applies_from_the_chosen_step(root):
    code, doc = cli_json(root, "--step", "25", "--prune", "--keep", "1", "--keep-every", "10",
                         restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 25
    assert present(root) == [10, 20, 25]  # 30..40 are in the quarantine, 5 and 15 pruned
    assert sorted(s for s in (30, 35, 40) if (root / "quarantine" / f"step-{s:08d}").is_dir()) \
        == [30, 35, 40]


@pytest.mark.parametrize("argv", [
    ["--prune"], ["--keep", "2"], ["--prune", "--keep", "0"],
    ["--prune", "--keep", "2", "--keep-every", "0"],
    ["--prune", "--keep", "2", "--best", "loss"],
    ["--prune", "--keep", "2", "--keep-best", "2"],
    ["--prune", "--keep", "2", "--best", "loss:mx", "--keep-best", "1"],
    ["--keep-every", "10"], ["--best", "loss", "--keep-best", "1"],
    ["--prune", "--keep", "2", "--best", ":max", "--keep-best", "1"],
])
def test_bad_policies_exit_2_and_change_nothing(root, argv):
    with pytest.raises(SystemExit) as e:
        cli(root, *argv, restore=True)
    assert e.value.code == 2
    assert present(root) == STEPS
