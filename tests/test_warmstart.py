"""tests/warmstart.py, which starts the suite's MPI ranks warm, behaves as ``python`` would.

The suite trusts it with every multi-rank test, so what mpiexec and the tests see through it is
checked here against real processes: the exit code, death by a signal (SIGKILL too), signals
forwarded to the script's handlers, the standard streams and other descriptors, the environment,
the working directory and umask, and the fallback to a plain ``python`` when no server answers.
Each test talks to the session's server (conftest.py's ``warm_ranks``); with ``MPICKPT_WARM=0``
there is none and the tests of the warm path skip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import WARMSTART
from warmstart import SOCKET_ENV

needs_server = pytest.mark.skipif(not os.environ.get(SOCKET_ENV) and
                                  os.environ.get("MPICKPT_WARM") == "0",
                                  reason="MPICKPT_WARM=0: no warm-start server")


def shim(*args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", "-E", str(WARMSTART), *args],
                            env={**os.environ, **(env or {})}, **kw)  # type: ignore[arg-type]


def run(code: str, **kw: object) -> subprocess.CompletedProcess:
    p = shim("-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


WARM = "import sys; print('torch' in sys.modules, end='')"  # a warm child has it imported


@needs_server
def test_the_script_runs_warm_and_its_exit_code_and_streams_come_back():
    job = run(WARM + "; print('err', file=sys.stderr); sys.exit(7)")
    assert job.returncode == 7, job.stderr
    assert job.stdout == "True" and job.stderr == "err\n"
    job = run("raise ValueError('boom')")
    assert job.returncode == 1 and "ValueError: boom" in job.stderr


@needs_server
def test_environment_directory_umask_and_an_inherited_descriptor_are_the_callers(tmp_path):
    r, w = os.pipe()
    code = ("import os; os.write(int(os.environ['FD']), "
            "f\"{os.getcwd()}|{os.environ['X']}|{os.umask(0):o}\".encode())")
    old = os.umask(0o027)
    try:
        p = shim("-c", code, env={"X": "y z", "FD": str(w)}, cwd=tmp_path, pass_fds=(w,))
    finally:
        os.umask(old)
    os.close(w)
    assert p.wait(timeout=60) == 0
    with os.fdopen(r) as f:
        assert f.read() == f"{tmp_path}|y z|27"


@needs_server
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_killed_by_a_signal_ends_the_shim_by_the_same_signal(tmp_path, sig):
    pidfile = tmp_path / "pid"
    p = shim("-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                   "time.sleep(60)")
    child = wait_for_pid(pidfile)
    assert child != p.pid  # the script runs in the server's child, not in the shim
    os.kill(child, sig)
    assert p.wait(timeout=30) == -sig


@needs_server
def test_a_signal_to_the_shim_reaches_the_scripts_handler(tmp_path):
    pidfile = tmp_path / "pid"
    p = shim("-c", "import os, signal, sys, time\n"
                   "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(42))\n"
                   f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                   "time.sleep(60)\n")
    wait_for_pid(pidfile)
    p.send_signal(signal.SIGUSR2)
    assert p.wait(timeout=30) == 42


@needs_server
def test_the_shim_killed_takes_the_child_with_it(tmp_path):
    pidfile = tmp_path / "pid"
    p = shim("-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                   "time.sleep(60)")
    child = wait_for_pid(pidfile)
    p.kill()
    p.wait(timeout=30)
    end = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < end, f"the child {child} outlived its shim"
        time.sleep(0.05)


def test_without_a_server_it_runs_the_real_python(tmp_path):
    env = {SOCKET_ENV: str(tmp_path / "no-such.sock")}
    job = run(WARM + "; import sys; sys.exit(3)", env=env)
    assert job.returncode == 3 and job.stdout == "False", job.stderr
    job = run(WARM, env={SOCKET_ENV: ""})
    assert job.returncode == 0 and job.stdout == "False", job.stderr


def wait_for_pid(path: Path) -> int:
    end = time.monotonic() + 60
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < end, f"the script never wrote {path}"
        time.sleep(0.02)
    return int(path.read_text())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
