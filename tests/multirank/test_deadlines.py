"""Deadlines: a rank that hangs or dies never hangs the job, and every surviving rank says who.

Real 4-rank jobs with a 3 s collective deadline and a 3 s roll call (MPICKPT_TIMEOUT_GRACE).
When a collective misses its deadline, rank 0 calls the roll and every waiting rank logs the
ranks that did not arrive and the phase they were last seen in (or, when rank 0 is the one
missing, that rank 0 did not answer), then the job aborts with EXIT_COLLECTIVE_TIMEOUT by
itself, well before the test's own timeout. The last committed checkpoint stays.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness import SCENARIOS, Job, run_mpi

from mpickpt.exitcodes import EXIT_COLLECTIVE_TIMEOUT
from mpickpt.format import rootdir
from mpickpt.mpi.protocol import DEFAULT_TIMEOUT, resolve_timeout
from mpickpt.ranks import rank_ranges, ranks_text

N, DEADLINE, GRACE = 4, 3, 3
JOB_TIMEOUT = 180  # the harness kills a job that outlives this: a hang
ENDS_WITHIN = 90  # a job that aborts at its deadline ends long before that
SUITE = "deadline"


@contextmanager
def counted(guarantees, case: str) -> Iterator[None]:
    """Count the case in the guarantee report whether its checks pass or not."""
    try:
        yield
    except pytest.fail.Exception as e:
        guarantees.record(SUITE, case, "hang" if " hung for " in str(e) else "failed",
                          str(e)[:2000])
        raise
    except AssertionError as e:
        guarantees.record(SUITE, case, "failed", str(e)[:2000])
        raise
    guarantees.record(SUITE, case, "correct")


def committed_steps(root: Path) -> list[int]:
    return sorted(step for step, _ in rootdir.committed(str(root)))


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def run(script: str, args: list[str], env: dict[str, str]) -> tuple[Job, float]:
    t0 = time.monotonic()
    job = run_mpi(N, [str(SCENARIOS / script), *args],
                  env={"MPICKPT_TIMEOUT_GRACE": str(GRACE), **env}, timeout=JOB_TIMEOUT)
    return job, time.monotonic() - t0


def save_hang(root: Path, fault: str) -> tuple[Job, float]:
    """save_hang.py: 15 steps, a save every 5 (each waited for), ``fault`` injected."""
    return run("save_hang.py", [str(root), "15", str(DEADLINE)], {"MPICKPT_FAULT": fault})


@contextmanager
def hung(tmp_path: Path, guarantees, fault: str, case: str, committed: list[int]
         ) -> Iterator[Job]:
    """save_hang.py with ``fault``, counted as ``case``: the job ends at the deadline (the
    block checks what every rank said), and the steps ``committed`` before are still there."""
    root = tmp_path / "ckpt"
    job, took = save_hang(root, fault)
    with counted(guarantees, case):
        ended_at_deadline(job, took)
        yield job
        assert committed_steps(root) == committed, step_dirs(root)


def timed_out(job: Job, rank: int, phase: str) -> str:
    """The details of ``rank``'s deadline log line for ``phase`` (fails if there is none)."""
    head = (f"[mpickpt rank {rank}] ERROR rank {rank}: the other ranks did not all reach phase "
            f"{phase!r} within {DEADLINE} s; ")
    tail = f"; aborting the job (exit code {EXIT_COLLECTIVE_TIMEOUT})"
    found = [line[len(head):line.index(tail)] for line in job.stderr.splitlines()
             if line.startswith(head) and tail in line]
    assert len(found) == 1, f"rank {rank} did not log its missed deadline once\n{job.output}"
    return found[0]


def ended_at_deadline(job: Job, took: float) -> None:
    assert job.returncode == EXIT_COLLECTIVE_TIMEOUT, job.output
    assert took < ENDS_WITHIN, f"the job took {took:.0f} s to abort\n{job.output}"
    assert "finished" not in job.stdout, job.output


def named_missing(details: str, missing: str, *answered: tuple[str, str]) -> re.Match[str]:
    """The roll call's report: ``missing`` did not arrive (last seen in some phase, returned as
    group 1), each ``(ranks, phase)`` of ``answered`` answered waiting in that phase."""
    waiting = " and ".join(rf"{re.escape(ranks)} waiting in phase {re.escape(repr(phase))} "
                           r"\(collective #\d+\)" for ranks, phase in answered)
    pattern = (rf"did not arrive: {re.escape(missing)}, last seen in phase '([a-z_-]+)' "
               rf"\([^)]*\); rank 0's roll call was answered within {GRACE} s by {waiting}$")
    m = re.match(pattern, details)
    assert m, f"{details!r} does not match {pattern!r}"
    return m


@pytest.mark.guarantee("no-hang")
@pytest.mark.quick
def test_rank_hung_mid_write_is_named_by_every_surviving_rank(tmp_path, guarantees):
    with hung(tmp_path, guarantees, "mid-write:2:hang:10", "rank 2 of 4 hangs mid-write",
              [5]) as job:
        # the vote is a gather: rank 0 waits for rank 2's entry, ranks 1 and 3 sent theirs and
        # wait for the outcome; rank 2 completed step 5's save (the commit), never voted
        for r, phase in ((0, "vote"), (1, "commit"), (3, "commit")):
            details = timed_out(job, r, phase)
            m = named_missing(details, "rank 2", ("rank 0", "vote"), ("ranks 1,3", "commit"))
            assert m.group(1) == "commit", details


@pytest.mark.guarantee("no-hang")
def test_rank_0_hung_the_others_say_it_did_not_answer(tmp_path, guarantees):
    with hung(tmp_path, guarantees, "mid-write:0:hang:10", "rank 0 of 4 hangs mid-write",
              [5]) as job:
        for r in (1, 2, 3):  # each sent its entry and waits for the outcome
            details = timed_out(job, r, "commit")
            assert re.match(rf"rank 0 did not answer within {GRACE} s, so rank 0 did not arrive "
                            r"\(last seen in phase 'commit' \(collective #\d+\), the last "
                            r"collective every rank completed\)", details), details


@pytest.mark.guarantee("no-hang")
def test_two_hung_ranks_are_named_as_one_range(tmp_path, guarantees):
    with hung(tmp_path, guarantees, "mid-write:2:hang:10,mid-write:3:hang:10",
              "ranks 2 and 3 of 4 hang mid-write", [5]) as job:
        for r, phase in ((0, "vote"), (1, "commit")):
            m = named_missing(timed_out(job, r, phase), "ranks 2-3", ("rank 0", "vote"),
                              ("rank 1", "commit"))
            assert m.group(1) == "commit", m.string


@pytest.mark.guarantee("no-hang")
def test_rank_hung_after_the_last_commit_is_noticed_at_close(tmp_path, guarantees):
    with hung(tmp_path, guarantees, "after-commit-before-retention:0:hang:15",
              "rank 0 of 4 hangs after the last commit", [5, 10, 15]) as job:
        for r in (1, 2, 3):
            details = timed_out(job, r, "close")
            assert details.startswith(f"rank 0 did not answer within {GRACE} s, so rank 0 did "
                                      "not arrive (last seen in phase 'commit'"), details


@pytest.mark.guarantee("no-hang")
def test_rank_that_stops_calling_should_exit_is_named(tmp_path, guarantees):
    """The per-step exit vote has the deadline too; here it comes from $MPICKPT_TIMEOUT."""
    root = tmp_path / "ckpt"
    job, took = run("deadlines_poll.py", [str(root), "60", "env", "2", "hang", "20"],
                    {"MPICKPT_TIMEOUT": str(DEADLINE)})
    with counted(guarantees, "rank 2 of 4 stops calling should_exit"):
        ended_at_deadline(job, took)
        assert "rank 2: hang before should_exit of step 20" in job.stdout, job.output
        for r in (0, 1, 3):
            details = timed_out(job, r, "should_exit")
            m = re.match(r"did not arrive: rank 2, last seen in phase 'should_exit' "
                         r"\(call #\d+, step (\d+)\); rank 0's roll call was answered", details)
            assert m, details
            # rank 2 ran should_exit for step 19, so it was seen at least at 18 (the vote of
            # step 19 completes only where rank 2's part of it got through)
            assert int(m.group(1)) in (18, 19), details


@pytest.mark.guarantee("no-hang")
def test_rank_killed_before_should_exit_does_not_hang_the_job(tmp_path, guarantees):
    """A SIGKILLed rank: MPICH's hydra ends the whole job at once (SIGKILL to every rank, so no
    rank can log anything, and its banner names whichever process it reaped first). A launcher
    that leaves the others running lets them miss the exit vote's deadline instead, and then
    every one of them must name the dead rank."""
    root = tmp_path / "ckpt"
    job, took = run("deadlines_poll.py", [str(root), "60", str(DEADLINE), "2", "kill", "20"], {})
    with counted(guarantees, "rank 2 of 4 killed before should_exit"):
        assert job.returncode != 0, job.output
        assert took < ENDS_WITHIN, f"the job took {took:.0f} s to end\n{job.output}"
        assert "rank 2: kill before should_exit of step 20" in job.stdout, job.output
        assert "finished" not in job.stdout, job.output
        if job.returncode == EXIT_COLLECTIVE_TIMEOUT:  # the launcher left the others running
            for r in (0, 1, 3):
                assert timed_out(job, r, "should_exit").startswith(
                    "did not arrive: rank 2, last seen in phase 'should_exit'"), job.output


# --------------------------------------------------------------------------------- unit level


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([], ""), ([7], "7"), ([1, 3, 4, 5], "1,3-5"), ([5, 4, 3, 1, 3], "1,3-5"),
     ([0, 1, 2, 3], "0-3"), ([0, 2, 4, 5, 6, 9], "0,2,4-6,9")],
)
@pytest.mark.quick
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_rank_ranges_of_a_large_scattered_set_are_cut_short():
    ranks = list(range(0, 4096, 2))  # 2048 ranges of one rank each
    text = rank_ranges(ranks, limit=4)
    assert text == "0,2,4,6,... and 2044 more ranks"
    assert rank_ranges(range(4096), limit=4) == "0-4095"  # contiguous: one range, any N


@pytest.mark.quick
def test_ranks_text():
    assert ranks_text([2]) == "rank 2"
    assert ranks_text([3, 2]) == "ranks 2-3"
    assert ranks_text([1, 3, 4, 5]) == "ranks 1,3-5"


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("MPICKPT_TIMEOUT", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT == 900
    monkeypatch.setenv("MPICKPT_TIMEOUT", "42.5")
    assert resolve_timeout(None) == 42.5
    assert resolve_timeout(7) == 7  # an explicit timeout wins
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("MPICKPT_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"MPICKPT_TIMEOUT={bad!r}"):
            resolve_timeout(None)
