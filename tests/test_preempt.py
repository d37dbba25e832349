"""mpickpt.preempt: the signal held from ``import mpickpt`` on, and what it never does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_import_holds_the_preemption_signal():
    p = run("import os, signal, mpickpt\nfrom mpickpt import preempt\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\nprint(preempt.kind() == preempt.PREEMPT)")
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr


def test_a_signal_that_comes_during_the_interpreters_teardown_is_ignored():
    """Python resets its handlers to the default after the atexit hooks; SIGUSR2's default would
    kill a program that has finished (a late Slurm ``--signal``). A shell sends it every half
    millisecond until the process is gone, so it meets the last stages of the teardown too (its
    output goes nowhere: a pipe it held open would keep this test waiting for it)."""
    p = run("import os, subprocess, time, mpickpt\n"
            "subprocess.Popen(['sh', '-c', f'while kill -USR2 {os.getpid()} 2>/dev/null; '\n"
            "                  'do sleep 0.0005; done'], stdout=subprocess.DEVNULL,\n"
            "                 stderr=subprocess.DEVNULL)\n"
            "time.sleep(0.05)\nprint('done', flush=True)")
    assert p.returncode == 0 and p.stdout.strip() == "done", (p.returncode, p.stderr)


def test_import_leaves_a_handler_of_the_programs_own_alone():
    p = run("import signal\nseen = []\nsignal.signal(signal.SIGUSR2, lambda *a: seen.append(1))\n"
            "import os, mpickpt\nos.kill(os.getpid(), signal.SIGUSR2)\n"
            "from mpickpt import preempt\nprint(seen, preempt.kind())")
    assert p.returncode == 0 and p.stdout.strip() == "[1] 0", p.stderr


def test_a_bad_signal_name_does_not_break_the_import_but_the_checkpointer_refuses_it():
    p = run("import mpickpt\nprint(mpickpt.__version__)", MPICKPT_SIGNAL="SIGBOGUS")
    assert p.returncode == 0, p.stderr
    from mpickpt import preempt
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MPICKPT_SIGNAL", "SIGBOGUS")
        with pytest.raises(ValueError, match="SIGBOGUS"):
            preempt.signals()


def test_preemption_false_ignores_the_flag(tmp_path):
    p = run("import os, signal, mpickpt, torch\n"
            f"ck = mpickpt.Checkpointer({str(tmp_path)!r}, preemption=False)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\n"
            "print([ck.should_exit(s, {'w': torch.zeros(1)}) for s in range(3)])\nck.close()")
    assert p.returncode == 0 and p.stdout.strip() == "[False, False, False]", p.stderr


def test_the_exit_vote_tells_a_raised_flag_one_call_later_and_names_the_rank():
    """mpickpt.mpi.exitvote on one rank: a call completes the allreduce the previous call
    started, so a flag raised at one step is agreed at the next, with the rank that raised it;
    the roll call (mpickpt.mpi.rollcall) counts each completed collective."""
    from mpickpt import preempt
    from mpickpt.mpi.exitvote import ExitVote
    from mpickpt.mpi.protocol import Protocol

    proto = Protocol(None, timeout=30)
    vote = ExitVote(proto)
    try:
        assert vote.poll(preempt.NONE, proto.rank, 1) is None
        assert vote.poll(preempt.PREEMPT, proto.rank, 2) is None  # started, not yet agreed
        assert vote.poll(preempt.NONE, proto.rank, 3) == (preempt.PREEMPT, proto.rank)
        assert vote._roll.seq == 2  # the two allreduces completed so far
    finally:
        vote.free()
        proto.free()


@pytest.mark.parametrize("preemption", [True, False])
def test_rank_0_says_ready_once_every_rank_has_reached_should_exit(tmp_path, preemption):
    """MPICKPT_READY_FILE (the job template's handshake) appears at the should_exit call that
    completes the first exit vote, not at the Checkpointer's creation; never when the
    Checkpointer does not watch the preemption signals."""
    ready = tmp_path / "ready"
    p = run("import os, mpickpt, torch\n"
            f"ck = mpickpt.Checkpointer({str(tmp_path / 'ckpt')!r}, preemption={preemption})\n"
            f"seen = [os.path.exists({str(ready)!r})]\n"
            "for s in range(3):\n"
            "    ck.should_exit(s, {'w': torch.zeros(1)})\n"
            f"    seen.append(os.path.exists({str(ready)!r}))\n"
            "ck.close()\nprint(seen)", MPICKPT_READY_FILE=str(ready))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ("[False, False, True, True]" if preemption
                                else "[False, False, False, False]"), p.stderr


def test_a_ready_file_that_cannot_be_created_is_said_and_the_job_goes_on(tmp_path):
    ready = tmp_path / "no-such-dir" / "ready"
    p = run("import mpickpt, torch\n"
            f"ck = mpickpt.Checkpointer({str(tmp_path / 'ckpt')!r})\n"
            "print([ck.should_exit(s, {'w': torch.zeros(1)}) for s in range(3)])\nck.close()",
            MPICKPT_READY_FILE=str(ready))
    assert p.returncode == 0 and p.stdout.strip() == "[False, False, False]", p.stderr
    assert f"cannot create MPICKPT_READY_FILE={ready}" in p.stderr, p.stderr
