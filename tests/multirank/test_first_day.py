"""What a new user hits first, each with real MPI jobs (tests/scenarios/first_day.py): a ROOT not
shared by every rank, a forgotten close(), metadata that is not JSON, a typo in ``replicated``,
a step saved twice, saves that come faster than they persist (waiting or skipped), retention
beyond keep-last-N, ``mpickpt.Values``, a preemption signal before the Checkpointer exists, and
a second job saving into a ROOT another one holds."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from harness import SCENARIOS, job_holding, manifest, run_mpi, train

SCENARIO = str(SCENARIOS / "first_day.py")


def job(n: int, mode: str, base: Path, *extra: str, run: bool = False,
        env: dict[str, str] | None = None):
    args = ["-m", "mpickpt.run"] if run else []
    return run_mpi(n, [*args, SCENARIO, mode, str(base), *extra], env=env, timeout=120)


def seen(base: Path, mode: str, n: int) -> list[dict]:
    return [json.loads((base / "out" / f"{mode}-rank-{r}.json").read_text()) for r in range(n)]


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*")
                  if "." not in p.name and (p / "MANIFEST.json").exists())


def test_a_root_that_ranks_do_not_share_is_refused_on_every_rank(tmp_path):
    """Ranks 1 and 3 have their own directory (node-local storage): the first save refuses on
    every rank before it writes anything, naming them and their host, and rank 0's ROOT holds
    nothing (before, rank 0 'committed' checkpoints whose other shards were elsewhere)."""
    p = job(4, "not-shared", tmp_path)
    assert p.returncode == 0, p.output
    assert [s["start"] for s in seen(tmp_path, "not-shared", 4)] == [None] * 4
    errors = [s["error"] for s in seen(tmp_path, "not-shared", 4)]
    assert all(errors) and len(set(errors)) == 1, errors
    assert "ranks 1,3 on " + socket.gethostname() in errors[0]
    assert str(tmp_path / "shared") in errors[0] and "node-local" in errors[0]
    assert not list((tmp_path / "shared").iterdir())


def test_restore_says_so_when_every_checkpoint_lacks_other_ranks_shards(tmp_path):
    """What a ROOT that was not shared left behind (before the check at construction): rank 0's
    directory with every step's manifest and only rank 0's shard."""
    root = tmp_path / "ckpt"
    assert train(2, root, 10, every=5).returncode == 0
    for shard in root.glob("step-*/rank-00001.h5"):
        shard.unlink()
    p = train(2, root, 10, every=5)
    assert p.returncode == 0, p.output
    assert "every checkpoint under" in p.stderr and "lacks shards of some ranks" in p.stderr
    assert "not one directory shared by every rank" in p.stderr, p.output


@pytest.mark.parametrize("run", [False, True], ids=["mpiexec-python", "mpickpt.run"])
def test_a_forgotten_close_still_commits_the_last_save(tmp_path, run):
    p = job(2, "no-close", tmp_path, run=run)
    assert p.returncode == 0, p.output
    assert committed(tmp_path / "ckpt") == [1, 2], p.output
    assert "without Checkpointer.close(): waiting for the save of step 2" in p.stderr
    assert "cannot schedule new futures" not in p.output


def test_a_last_save_that_cannot_commit_at_exit_fails_the_job(tmp_path):
    p = job(2, "no-close", tmp_path, env={"MPICKPT_FAULT": "mid-write:1:raise:2"})
    assert p.returncode != 0, p.output
    assert committed(tmp_path / "ckpt") == [1]
    assert "the save of step 2 could not commit" in p.stderr, p.output


def test_ranks_that_ask_restore_for_other_steps_are_refused_at_once_naming_them(tmp_path):
    """Each rank waited for the others to load its step, and the job ended at the deadline."""
    p = job(2, "other-steps", tmp_path)
    assert p.returncode == 0, p.output
    for s in seen(tmp_path, "other-steps", 2):
        assert s["error"] == ("restore() was called with other arguments on other ranks (rank 0: "
                              "step=1, upto=None; rank 1: step=2, upto=None): every rank must "
                              "ask for the same checkpoint; nothing was restored"), s
        assert s["seconds"] < 30, s


def test_a_failed_save_already_raised_does_not_fail_the_job_at_exit(tmp_path):
    """The caller saw the StateTreeError: at exit nothing in flight is lost, and the exit is 0."""
    p = job(2, "typo-no-close", tmp_path)
    assert p.returncode == 0, p.output
    assert all("'modle' matches nothing" in s["error"] for s in seen(tmp_path, "typo-no-close", 2))
    assert "could not commit" not in p.stderr, p.output


@pytest.mark.parametrize("who", ["every rank", "rank 1"])
def test_metadata_takes_scalars_and_refuses_the_rest_naming_the_key(tmp_path, who):
    extra = ["--only-rank", "1"] if who == "rank 1" else []
    p = job(2, "metadata", tmp_path, *extra)
    assert p.returncode == 0, p.output
    ranks = seen(tmp_path, "metadata", 2)
    want = {"loss": 0.25, "acc": 0.5, "n": 7, "bad_run": "nan", "tags": ["a", 1], "lr": 0.001}
    assert manifest(tmp_path / "ckpt", 1)["metadata"] == want
    for r, s in enumerate(ranks):
        assert s["first"] and s["metadata"] == want and s["restored"] == want
        assert s["second"] == [False] and s["third"], s  # aborted everywhere, then training goes on
        if who == "every rank" or r == 1:
            assert s["error"].startswith("metadata['opt']['sched']: cannot save a value of type "
                                         "object"), s["error"]
        else:
            assert s["error"] is None
        assert s["seconds"] > 0 and s["total"] == 2 * s["bytes"] > 0
    assert committed(tmp_path / "ckpt") == [1, 3]
    restored = next(line for line in p.stderr.splitlines() if "restored step 1 from" in line)
    # a small checkpoint's rate in a unit that fits, not "0.00 GB/s"
    assert re.search(r"rank\(s\), \d+(\.\d)? (B|kB|MB)/s$", restored), restored
    committed_line = next(line for line in p.stderr.splitlines() if "committed:" in line)
    assert re.search(r"persist \d+(\.\d)? (B|kB|MB)/s \(rank 0\)", committed_line), committed_line


def test_a_replicated_path_that_matches_nothing_is_refused_listing_the_keys(tmp_path):
    p = job(2, "replicated-typo", tmp_path)
    assert p.returncode == 0, p.output
    for s in seen(tmp_path, "replicated-typo", 2):
        assert "'modle' matches nothing in the state" in s["error"]
        assert "top-level keys are 'model', 'step'" in s["error"]
    assert committed(tmp_path / "ckpt") == []


def test_saving_a_committed_step_again_warns_that_it_replaces_it(tmp_path):
    p = job(2, "again", tmp_path)
    assert p.returncode == 0, p.output
    assert p.stderr.count("step 2 was already committed; this save replaces it") == 1, p.output
    tree = manifest(tmp_path / "ckpt", 2)["ranks"][0]["tree"]
    assert ["step", {"type": "int", "value": 99}] in tree["items"]


def test_saves_that_wait_for_earlier_ones_are_logged_once(tmp_path):
    p = job(2, "busy", tmp_path, env={"MPICKPT_FAULT": "after-fsync-before-vote:*:delay"})
    assert p.returncode == 0, p.output
    lines = [x for x in p.stderr.splitlines()
             if "waits for an earlier" in x or "no longer wait" in x]
    assert len(lines) == 2 and all(x.startswith("[mpickpt rank 0]") for x in lines), lines
    assert "save of step 2 waits" in lines[0] and "saves no longer wait: 5 in a row" in lines[1]


def test_saves_skipped_when_busy_are_skipped_on_every_rank_and_never_wait(tmp_path):
    """if_busy="skip": rank 1 still writes step 1 (slowed down) when steps 2 and 3 come, rank 0
    does not: both skip them (one allreduce decides), save() returns at once, nothing raises
    with on_error="raise", and the log says it once when skips start and once when they stop."""
    p = job(2, "skip", tmp_path, env={"MPICKPT_FAULT": "after-fsync-before-vote:1:delay"})
    assert p.returncode == 0, p.output
    ranks = seen(tmp_path, "skip", 2)
    assert ranks[0]["outcomes"] == ranks[1]["outcomes"], ranks
    outcomes = {step: (committed, skipped) for step, committed, skipped in ranks[0]["outcomes"]}
    assert outcomes[1] == (True, False)
    assert outcomes[2] == outcomes[3] == (False, True)
    assert any(outcomes[s] == (True, False) for s in (5, 6)), outcomes
    assert all(not (c and s) for c, s in outcomes.values())
    assert all(r["last"] for r in ranks)
    assert max(c for r in ranks for c in r["calls"]) < 0.25, ranks
    taken = [s for s, (c, _) in outcomes.items() if c] + [7]
    assert committed(tmp_path / "ckpt") == taken
    lines = [x for x in p.stderr.splitlines() if " skipped" in x and "committed" not in x]
    assert len(lines) >= 2 and all(x.startswith("[mpickpt rank 0]") for x in lines), lines
    assert "save of step 2 skipped: an earlier save was still persisting" in lines[0]
    assert "taken after" in lines[1]


def test_retention_keeps_the_newest_every_kth_and_the_best(tmp_path):
    """keep=2, keep_every=4, best=("val", "min"), keep_best=1 over ten real saves."""
    p = job(2, "retention", tmp_path)
    assert p.returncode == 0, p.output
    after = {int(k): v for k, v in seen(tmp_path, "retention", 2)[0]["after"].items()}
    # val: 1 .9, 2 .8, 3 .3, 4 .7, 5 .6, 6 .5, 7 .4, 8 .35, 9 .5, 10 .6
    assert after[2] == [1, 2]
    assert after[3] == [2, 3]  # 1 is not best any more (3 is)
    assert after[7] == [3, 4, 6, 7]
    assert after[10] == [3, 4, 8, 9, 10]
    for step in range(1, 11):
        assert step in after[step]  # the newest is never deleted


@pytest.mark.quick
def test_values_are_restored_into_the_users_object(tmp_path):
    assert job(2, "values", tmp_path).returncode == 0
    p = job(2, "values", tmp_path, "--restore")
    assert p.returncode == 0, p.output
    assert seen(tmp_path, "values", 2) == [
        {"start": 5, "epoch": 3, "seen": 1200 + r, "best": 0.125} for r in range(2)]


def test_a_preemption_signal_before_the_checkpointer_exists_is_held(tmp_path):
    """Plain ``mpiexec python``: SIGUSR2 after ``import mpickpt`` but before the Checkpointer
    no longer kills the rank; the first should_exit agrees on it and checkpoints."""
    p = job(2, "early-signal", tmp_path)
    assert p.returncode == 3, p.output
    assert committed(tmp_path / "ckpt") == [2]
    assert "preemption signal on rank 1" in p.stderr


def test_a_job_whose_root_another_holds_is_refused_on_every_rank(tmp_path):
    """A real 2-rank job whose first save finds ROOT's writer lock held (as a saving job's rank
    0 holds it): RootInUseError on every rank, naming the holder, nothing written; once the
    lock is let go, the same job saves."""
    root = tmp_path / "ckpt"
    root.mkdir()
    with job_holding(root) as pid:
        p = job(2, "root-held", tmp_path)
        assert p.returncode == 0, p.output
        refused = [s["refused"] for s in seen(tmp_path, "root-held", 2)]
        assert all(r is not None and f"process {pid} (" in r for r in refused), refused
        assert sorted(x.name for x in root.iterdir()) == []
    p = job(2, "root-held", tmp_path)
    assert p.returncode == 0, p.output
    assert [s["refused"] for s in seen(tmp_path, "root-held", 2)] == [None, None]
    assert committed(root) == [10]
