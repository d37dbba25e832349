"""mpickpt-restore ROOT: choose, quarantine, roll back, prune; on trees left by crashed jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from clikit import (
    COMMITTED,
    PARTIAL,
    by_step,
    cli,
    cli_json,
    copy_tree,
    garble_manifest,
    listing,
    partial_dirs,
)
from harness import NO_DAC, flip_data_byte, job_holding, shard, starts, step_dir, train

from mpickpt.cli import EXIT_DAMAGED, EXIT_ERROR, EXIT_NO_CHECKPOINT, EXIT_OK


@pytest.fixture
def root2(tmp_path, tmp_path_factory):
    return copy_tree(2, tmp_path_factory, tmp_path / "ckpt")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_after_a_crash_reports_newest_and_quarantines_the_partial(tmp_path, tmp_path_factory, n):
    root = copy_tree(n, tmp_path_factory, tmp_path / "ckpt")
    partial = partial_dirs(root)[0]
    code, doc = cli_json(root, restore=True)
    assert code == EXIT_OK
    assert doc["chosen"]["step"] == 20 and doc["chosen"]["world_size"] == n
    assert doc["chosen"]["path"] == str(step_dir(root, 20))
    assert doc["chosen"]["bytes"] == sum(
        shard(root, 20, r).stat().st_size for r in range(n))
    assert doc["chosen"]["age_s"] >= 0 and doc["chosen"]["verified"] == "quick"
    assert doc["resume"]["world_size"] == n and doc["resume"]["step"] == 20
    assert f"mpiexec -n {n} " in doc["resume"]["command"]
    assert [(a["action"], a["path"], a["done"]) for a in doc["actions"]] == [
        ("quarantine", str(partial), True)]
    assert listing(root) == sorted([
        "quarantine", f"quarantine/{partial.name}", "quarantine/QUARANTINE.jsonl",
        "stats.jsonl", *(f"step-{s:08d}" for s in COMMITTED)])
    log = [json.loads(x) for x in (root / "quarantine" / "QUARANTINE.jsonl").read_text()
           .splitlines()]
    assert [(r["from"], r["step"]) for r in log] == [(str(partial), PARTIAL)]
    assert "a save that never committed" in log[0]["reason"]
    # a second run finds nothing to do
    code, doc = cli_json(root, restore=True)
    assert code == EXIT_OK and doc["actions"] == [] and doc["chosen"]["step"] == 20


def test_human_report_says_what_to_run(root2):
    code, out, err = cli(root2, restore=True)
    assert code == EXIT_OK, err
    assert "GOOD  the job will resume from step 20" in out
    assert "mpiexec -n 2 <the job's command line, unchanged>" in out
    assert "restore(state, step=20)" in out
    assert "quarantined" in out and "a save that never committed" in out
    assert "\033[" not in out  # no colour when not on a terminal


def test_a_fresh_partial_is_left_alone_until_grace(root2):
    partial = partial_dirs(root2)[0]
    os.utime(partial)  # written just now: a job may still be writing it
    code, doc = cli_json(root2, restore=True)
    assert code == EXIT_OK and doc["actions"] == []
    assert [x["path"] for x in doc["left_alone"]] == [str(partial)]
    assert "--grace 0" in doc["left_alone"][0]["reason"]
    assert partial.exists()
    code, doc = cli_json(root2, "--grace", "0", restore=True)
    assert [a["path"] for a in doc["actions"]] == [str(partial)] and not partial.exists()


def test_a_partial_is_left_alone_while_a_job_holds_root_even_past_grace(root2):
    partial = partial_dirs(root2)[0]
    with job_holding(root2) as pid:
        code, doc = cli_json(root2, "--grace", "0", restore=True)
        assert code == EXIT_OK and doc["actions"] == [] and partial.exists()
        assert [x["path"] for x in doc["left_alone"]] == [str(partial)]
        assert f"process {pid} (" in doc["left_alone"][0]["reason"]
        assert "writer lock" in doc["left_alone"][0]["reason"]
    code, doc = cli_json(root2, "--grace", "0", restore=True)  # the job is gone
    assert [a["path"] for a in doc["actions"]] == [str(partial)] and not partial.exists()


@pytest.mark.parametrize("argv", [["--step", "10"], ["--prune", "--keep", "1"]])
def test_a_rollback_or_a_prune_is_refused_while_a_job_holds_root(root2, argv):
    """Either would hide or remove checkpoints under a job that saves into ROOT: refused,
    naming the job's process, nothing changed; a dry run still shows the plan."""
    before = sorted(p.name for p in root2.iterdir())
    with job_holding(root2) as pid:
        code, doc = cli_json(root2, *argv, restore=True)
        assert code == EXIT_ERROR, doc
        assert f"process {pid} (" in doc["error"] and "Nothing was changed" in doc["error"]
        assert sorted(p.name for p in root2.iterdir()) == before
        code, doc = cli_json(root2, "--dry-run", *argv, restore=True)
        assert code == EXIT_OK and doc["actions"], doc
        assert sorted(p.name for p in root2.iterdir()) == before
    code, doc = cli_json(root2, *argv, restore=True)  # the job has ended
    assert code == EXIT_OK and doc["actions"] and all(a["done"] for a in doc["actions"]), doc
    assert sorted(p.name for p in root2.iterdir()) != before


def test_a_job_that_takes_root_while_the_plan_is_made_is_not_raced(root2, monkeypatch):
    """The lock found free at the start, a job holding it by the time the plan is carried out:
    refused, nothing changed; and the plan is not carried out once the checkpoints changed
    under it (a job saved and ended meanwhile)."""
    import shutil

    from mpickpt.cli import verify
    from mpickpt.format import rootlock

    before = sorted(p.name for p in root2.iterdir())
    with job_holding(root2) as pid:
        monkeypatch.setattr(rootlock, "free", lambda root: True)  # as it was at the start
        code, doc = cli_json(root2, "--prune", "--keep", "1", restore=True)
        assert code == EXIT_ERROR and f"process {pid} (" in doc["error"], doc
        assert sorted(p.name for p in root2.iterdir()) == before
    monkeypatch.undo()
    survey = verify.survey

    def a_job_saves_meanwhile(*args, **kwargs):
        seen = survey(*args, **kwargs)
        shutil.copytree(step_dir(root2, 20), root2 / "step-00000099")
        return seen

    monkeypatch.setattr(verify, "survey", a_job_saves_meanwhile)
    code, doc = cli_json(root2, "--prune", "--keep", "1", restore=True)
    assert code == EXIT_ERROR and "changed while this command looked" in doc["error"], doc
    assert sorted(p.name for p in root2.iterdir()) == sorted([*before, "step-00000099"])
    assert rootlock.free(str(root2))  # let go after the refusal


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garble", "no-manifest"])
def test_damaged_newest_is_quarantined_and_the_older_one_chosen(root2, damage):
    level = "quick"
    if damage == "flip":
        path, tensor = flip_data_byte(root2, 20, rank=1)
        why, level = f"tensor '{tensor}': checksum mismatch", "full"
    elif damage == "truncate":
        path = shard(root2, 20, 0)
        size = path.stat().st_size
        os.truncate(path, size // 3)
        why = f"size is {size // 3} bytes, the manifest says {size}"
    elif damage == "delete":
        path = shard(root2, 20, 1)
        path.unlink()
        why = "cannot open: No such file or directory"
    elif damage == "garble":
        path, why = garble_manifest(root2, 20), "not valid JSON"
    else:
        path = step_dir(root2, 20) / "MANIFEST.json"
        path.unlink()
        why = "cannot open"
    code, doc = cli_json(root2, "--verify", level, restore=True)
    assert code == EXIT_OK
    assert doc["chosen"]["step"] == 15
    bad = by_step(doc)[(20, "corrupt")]
    assert bad["problems"][0]["file"] == str(path) and why in bad["problems"][0]["reason"]
    moved = {a["path"]: a for a in doc["actions"]}
    assert moved[str(step_dir(root2, 20))]["to"] == str(root2 / "quarantine" / "step-00000020")
    assert why in moved[str(step_dir(root2, 20))]["reason"]
    assert not step_dir(root2, 20).exists() and (root2 / "quarantine" / "step-00000020").is_dir()
    assert step_dir(root2, 15).is_dir() and step_dir(root2, 10).is_dir()


def test_quick_does_not_read_data_full_does(root2):
    flip_data_byte(root2, 20, rank=0)
    code, doc = cli_json(root2, "--dry-run", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 20  # sizes are intact
    code, doc = cli_json(root2, "--verify", "full", "--dry-run", restore=True)
    assert doc["chosen"]["step"] == 15 and doc["chosen"]["verified"] == "full"


def test_dry_run_changes_nothing(root2):
    garble_manifest(root2, 20)
    before = listing(root2)
    code, doc = cli_json(root2, "--dry-run", "--prune", "--keep", "1", restore=True)
    assert code == EXIT_OK and doc["dry_run"]
    assert sorted((a["action"], a["step"], a["done"]) for a in doc["actions"]) == [
        ("delete", 10, False), ("quarantine", 20, False), ("quarantine", PARTIAL, False)]
    assert listing(root2) == before
    code, out, _ = cli(root2, "--dry-run", restore=True)
    assert "would do (dry run, nothing was changed)" in out and "would quarantine" in out


def test_delete_removes_instead_of_quarantining(root2):
    garble_manifest(root2, 20)
    code, doc = cli_json(root2, "--delete", restore=True)
    assert code == EXIT_OK
    assert sorted((a["action"], a["step"]) for a in doc["actions"]) == [
        ("delete", 20), ("delete", PARTIAL)]
    assert listing(root2) == ["stats.jsonl", "step-00000010", "step-00000015"]


def test_prune_keeps_the_chosen_and_the_newest_before_it(root2):
    code, doc = cli_json(root2, "--prune", "--keep", "2", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 20
    assert [(a["action"], a["step"]) for a in doc["actions"] if a["action"] == "delete"] == [
        ("delete", 10)]
    assert [s for s in (20, 15, 10) if step_dir(root2, s).exists()] == [20, 15]
    # after a rollback the chosen one is the older step: keep 1 keeps exactly it
    code, doc = cli_json(root2, "--step", "15", "--prune", "--keep", "1", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 15
    assert [s for s in (20, 15, 10) if step_dir(root2, s).exists()] == [15]


def test_a_prune_reads_the_step_it_keeps_in_full_even_under_the_quick_check(root2):
    """A flipped bit in the newest passes the quick check: a prune that trusted it deleted
    every checkpoint restore could fall back to."""
    flip_data_byte(root2, 20, rank=0)
    code, doc = cli_json(root2, "--prune", "--keep", "1", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 15, doc
    assert doc["chosen"]["verified"] == "full" and doc["verify"] == "full"
    assert by_step(doc)[(20, "corrupt")]
    assert [s for s in (20, 15, 10) if step_dir(root2, s).exists()] == [15]
    assert (root2 / "quarantine" / "step-00000020").is_dir()
    # a rollback with a prune reads its target in full too
    flip_data_byte(root2, 15, rank=1)
    code, doc = cli_json(root2, "--step", "15", "--prune", "--keep", "1", restore=True)
    assert code == EXIT_DAMAGED and "fails verification" in doc["error"], doc
    assert step_dir(root2, 15).exists()


@pytest.mark.quick
def test_rollback_then_the_next_restore_lands_on_it(root2, tmp_path):
    code, doc = cli_json(root2, "--step", "10", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 10
    moved = sorted(a["step"] for a in doc["actions"] if a["reason"].startswith("rolled back"))
    assert moved == [15, 20]
    record = json.loads((root2 / "ROLLBACK.json").read_text())
    assert (record["from_step"], record["to_step"]) == (20, 10)
    assert "@" in record["by"] and record["time"] > 0 and record["earlier"] == []
    assert sorted(m["step"] for m in record["moved"]) == [15, 20]
    assert doc["rollback"]["to_step"] == 10

    out = tmp_path / "out"
    job = train(2, root2, 20, out, every=5, keep=3, timeout=120)
    assert job.returncode == 0, job.output
    assert starts(out, 2) == [10, 10], job.output
    assert "restored step 10 from" in job.stderr, job.output
    # the rolled-back checkpoints stay in quarantine; the job wrote new ones
    assert (root2 / "quarantine" / "step-00000020").is_dir()
    assert step_dir(root2, 20).is_dir() and step_dir(root2, 15).is_dir()


def test_rollback_refuses_a_missing_or_damaged_step(root2):
    before = listing(root2)
    code, doc = cli_json(root2, "--step", "7", restore=True)
    assert code == EXIT_ERROR and "no committed checkpoint of step 7" in doc["error"]
    assert "committed steps: 20, 15, 10" in doc["error"]
    os.truncate(shard(root2, 15, 1), 10)
    code, doc = cli_json(root2, "--step", "15", restore=True)
    assert code == EXIT_DAMAGED and "step 15 fails verification" in doc["error"]
    assert "Nothing was changed" in doc["error"]
    assert listing(root2) == before


def test_rolling_back_twice_keeps_the_history_and_names_quarantined_steps(root2):
    assert cli_json(root2, "--step", "15", restore=True)[0] == EXIT_OK
    assert cli_json(root2, "--step", "10", restore=True)[0] == EXIT_OK
    record = json.loads((root2 / "ROLLBACK.json").read_text())
    assert (record["from_step"], record["to_step"]) == (15, 10)
    assert [(r["from_step"], r["to_step"]) for r in record["earlier"]] == [(20, 15)]
    code, doc = cli_json(root2, "--step", "20", restore=True)
    assert code == EXIT_ERROR
    assert f"mv {root2}/quarantine/step-00000020 {root2}/step-00000020" in doc["error"]


def test_nothing_good_exits_4(root2):
    for s in COMMITTED:
        os.truncate(shard(root2, s, 0), 100)
    code, doc = cli_json(root2, restore=True)
    assert code == EXIT_NO_CHECKPOINT and doc["chosen"] is None and doc["resume"] is None
    assert sorted(a["step"] for a in doc["actions"]) == [10, 15, 20, PARTIAL]
    assert [p.name for p in root2.iterdir() if p.name.startswith("step-")] == []
    code, out, _ = cli(root2, restore=True)
    assert code == EXIT_NO_CHECKPOINT and "NO GOOD CHECKPOINT" in out


def test_empty_and_missing_root(tmp_path):
    (tmp_path / "empty").mkdir()
    code, doc = cli_json(tmp_path / "empty", restore=True)
    assert code == EXIT_NO_CHECKPOINT and doc["checkpoints"] == [] and doc["actions"] == []
    code, doc = cli_json(tmp_path / "nowhere", restore=True)
    assert code == EXIT_ERROR and "no such directory" in doc["error"]
    code, _, err = cli(tmp_path / "nowhere", restore=True)
    assert code == EXIT_ERROR and "no such directory" in err


def test_another_format_version_is_left_in_place(root2):
    path = step_dir(root2, 20) / "MANIFEST.json"
    d = json.loads(path.read_text())
    d["version"] = 99
    path.write_text(json.dumps(d))
    code, doc = cli_json(root2, restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 15
    assert by_step(doc)[(20, "unsupported")]
    assert step_dir(root2, 20).is_dir()
    assert [x["path"] for x in doc["left_alone"]] == [str(step_dir(root2, 20))]


def test_a_step_directory_renamed_is_misnamed_left_in_place_and_never_chosen(root2):
    """Restore refuses a step whose manifest is another step's: the tools neither choose it nor
    let a prune delete what restore falls back to because of it, nor remove it."""
    os.rename(step_dir(root2, 20), step_dir(root2, 30))
    code, doc = cli_json("verify", root2)
    assert code == EXIT_DAMAGED and doc["current"] == 15, doc  # one fails verification
    bad = by_step(doc)[(30, "misnamed")]
    assert "is the manifest of step 20, not of step 30" in bad["problems"][0]["reason"]
    code, doc = cli_json(root2, "--prune", "--keep", "1", "--delete", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 15, doc
    assert [x["path"] for x in doc["left_alone"]] == [str(step_dir(root2, 30))]
    assert [s for s in (30, 15, 10) if step_dir(root2, s).exists()] == [30, 15]


def test_a_step_this_user_may_not_read_is_left_in_place_not_called_damaged(root2):
    """Permission denied says nothing of the bytes: --delete run by a user who may not read one
    shard (here root without its power over file modes) must not remove the checkpoint."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to act without root's override")
    shard(root2, 20, 1).chmod(0)
    p = subprocess.run(["setpriv", *NO_DAC, sys.executable, "-m", "mpickpt.cli.restore",
                        str(root2), "--delete", "--json"], capture_output=True, text=True,
                       timeout=120)
    doc = json.loads(p.stdout)
    assert p.returncode == EXIT_OK and doc["chosen"]["step"] == 15, p.stderr
    bad = by_step(doc)[(20, "unreadable")]
    assert "Permission denied" in bad["problems"][0]["reason"]
    assert [x["path"] for x in doc["left_alone"]] == [str(step_dir(root2, 20))]
    assert step_dir(root2, 20).is_dir() and shard(root2, 20, 1).exists()
    assert [a["step"] for a in doc["actions"]] == [PARTIAL]


def test_a_step_a_jobs_retention_removes_while_it_is_checked_is_gone_not_damaged(root2,
                                                                               monkeypatch):
    """ls, verify and mpickpt-restore run beside a live job: a step its retention removes
    between the listing and the check is no longer there, not corrupt (it failed the command)."""
    from mpickpt.cli import checks
    from mpickpt.format import rootdir

    quick = checks.quick

    def retained_meanwhile(entry):
        if entry.step == 10:
            rootdir.remove(entry.path, "another-run")  # as the job's retention does
        quick(entry)

    monkeypatch.setattr(checks, "quick", retained_meanwhile)
    code, doc = cli_json("verify", root2, "--verify", "quick")
    assert code == EXIT_OK and [c["step"] for c in doc["checkpoints"]
                                if c["status"] == "committed"] == [20, 15], doc
    assert 10 not in [c["step"] for c in doc["checkpoints"]]


def test_a_rollback_whose_move_fails_changes_nothing_and_says_so(root2):
    """Rolling back to 10 moves 15, then cannot move 20 (a directory this user may not move):
    15 comes back, no ROLLBACK.json, exit 1, and the report names step 20, which restore loads,
    not the step asked for."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to act without root's override")
    step_dir(root2, 20).chmod(0o555)
    p = subprocess.run(["setpriv", *NO_DAC, sys.executable, "-m", "mpickpt.cli.restore",
                        str(root2), "--step", "10", "--json"], capture_output=True, text=True,
                       timeout=120)
    step_dir(root2, 20).chmod(0o755)
    doc = json.loads(p.stdout)
    assert p.returncode == EXIT_ERROR, p.stdout
    assert doc["chosen"]["step"] == 20 and doc["next_restore"]["step"] == 20, doc
    moves = {a["step"]: a for a in doc["actions"] if a["step"] in (15, 20)}
    assert not moves[15]["done"] and "moved back" in moves[15]["error"]
    assert not moves[20]["done"] and "Permission denied" in moves[20]["error"]
    assert [s for s in (20, 15, 10) if step_dir(root2, s).is_dir()] == [20, 15, 10]
    assert not (root2 / "ROLLBACK.json").exists()
    assert not (root2 / "quarantine" / "step-00000015").exists()


@pytest.mark.parametrize("when", ["NaN", "1e300", "-1e300"])
def test_a_damaged_rollback_record_does_not_crash_the_tools(root2, when):
    """A ROLLBACK.json whose time is not a time a clock shows: ls and verify said 'internal
    error' with a traceback."""
    (root2 / "ROLLBACK.json").write_text(
        '{"format": "mpickpt-rollback", "version": 1, "time": ' + when + ', "by": "x", '
        '"from_step": 20, "to_step": 15, "moved": [], "earlier": []}')
    for argv in (["ls", root2], ["verify", root2, "--verify", "quick"]):
        code, _, err = cli(*argv)
        assert code == EXIT_OK and "Traceback" not in err and "internal error" not in err, err
        code, doc = cli_json(*argv)
        assert code == EXIT_OK and doc["current"] == 20


def test_bad_command_lines_exit_2(root2):
    for argv in (["--prune"], ["--keep", "2"], ["--prune", "--keep", "0"],
                 ["--list", "--step", "1"]):
        with pytest.raises(SystemExit) as e:
            cli(root2, *argv, restore=True)
        assert e.value.code == 2


def test_a_missing_or_file_root_is_said_once_and_plainly(tmp_path):
    code, out, err = cli(tmp_path / "nowhere", restore=True)
    assert code == EXIT_ERROR and out == ""
    assert err.count("no such directory") == 1 and len(err.strip().splitlines()) == 1, err
    afile = tmp_path / "ckpt.txt"
    afile.write_text("not a checkpoint")
    for argv, restore in (([afile], True), (["ls", afile], False), ([afile, "--list"], True),
                          (["inspect", afile], False), (["stats", afile], False)):
        code, out, err = cli(*argv, restore=restore)
        assert code == EXIT_ERROR, (argv, out, err)
        assert err.count(f"{afile} is a file, not a checkpoint directory") == 1, (argv, err)
        assert "does not exist" not in err and "no such directory" not in err
        code, doc = cli_json(*argv, restore=restore)
        assert code == EXIT_ERROR and "is a file, not a checkpoint directory" in doc["error"]


def test_the_rollback_notice_goes_once_the_rollback_is_undone(root2):
    """README: a rollback quarantines the newer checkpoints and writes ROLLBACK.json; moving
    them back (`mv`) undoes it. ls shows the notice while it is in effect, not after."""
    assert cli_json(root2, "--step", "10", restore=True)[0] == EXIT_OK
    code, out, _ = cli("ls", root2)
    assert "rolled back from step 20 to step 10" in out and "partly" not in out
    code, doc = cli_json("ls", root2)
    assert doc["current"] == 10 and doc["rollback"]["to_step"] == 10
    assert doc["rollback"]["undone"] == []
    # the documented undo, one directory at a time
    os.rename(root2 / "quarantine" / "step-00000020", step_dir(root2, 20))
    code, out, _ = cli("ls", root2)
    assert "rolled back from step 20 to step 10" in out
    assert "partly undone: step(s) 20 moved back into ROOT" in out
    os.rename(root2 / "quarantine" / "step-00000015", step_dir(root2, 15))
    code, out, _ = cli("ls", root2)
    assert code == EXIT_OK and "rolled back" not in out
    code, doc = cli_json("ls", root2)
    assert doc["current"] == 20 and doc["rollback"] is None
    assert (root2 / "ROLLBACK.json").exists()  # the record stays: it is history
