"""Test harness: launch real MPI jobs in a subprocess with a timeout, compare final states.

A plain module (not conftest.py: tests/slurm has its own conftest, and two modules named
``conftest`` cannot both be imported by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmstart import SOCKET_ENV

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "scenarios"
TRAIN = REPO / "examples" / "train.py"
# setpriv's options that take root's power to ignore file permissions (a job of root then meets
# EACCES as any user's does)
NO_DAC = ["--inh-caps=-dac_override,-dac_read_search",
          "--bounding-set=-dac_override,-dac_read_search"]


def mpiexec() -> list[str]:
    """The launcher: $MPICKPT_MPIEXEC, else the mpiexec next to this Python, else on PATH."""
    exe = os.environ.get("MPICKPT_MPIEXEC")
    if not exe:
        beside = Path(sys.executable).parent / "mpiexec"
        exe = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not exe:
        pytest.fail("no mpiexec found: install the 'mpich' wheel or a system MPI")
    cmd = [exe]
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in out or "OpenRTE" in out:
        cmd += ["--oversubscribe", "--allow-run-as-root"]
    return cmd


def torchrun(n: int, py: list[str] | None = None) -> list[str]:
    """torchrun for ``n`` ranks on this host (its own free rendezvous port), starting each rank
    as ``py`` (default: as :func:`python` says): ``[...] -m mpickpt.run script args`` runs a job
    under it."""
    # the agent, too, is forked warm: importing PyTorch cost it 3 CPU seconds per launch
    return [*python(), "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", "--monitor-interval=0.1", "--no-python", *(py or python())]


def torchrun_code(rc: int, output: str) -> int:
    """The job's exit code as the rank that ended it gave it: torchrun itself exits 1 whenever
    a worker failed, and names the first worker's code (negative: killed by that signal) under
    "Root Cause" in its report."""
    if rc == 0:
        return 0
    cause = output.rfind("Root Cause")
    m = re.search(r"exitcode\s*:\s*(-?\d+)", output[cause:]) if cause >= 0 else None
    return int(m.group(1)) if m else rc


def launcher(name: str, n: int) -> list[str]:
    """The command line that starts ``n`` ranks of Python: ``mpi`` (mpiexec) or ``torchrun``."""
    return [*mpiexec(), "-n", str(n), *python()] if name == "mpi" else torchrun(n)


WARMSTART = REPO / "tests" / "warmstart.py"


def python() -> list[str]:
    """How mpiexec starts a rank's Python: forked warm from the session's server
    (tests/warmstart.py, when conftest.py started one), else as itself."""
    if os.environ.get(SOCKET_ENV):
        return [sys.executable, "-S", "-E", str(WARMSTART)]
    return [sys.executable]


class Job(subprocess.CompletedProcess):
    @property
    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def run_mpi(n: int, args: list[str], *, env: dict[str, str] | None = None,
            timeout: float = 180, prefix: list[str] | None = None, warm: bool = True) -> Job:
    """Run ``python ARGS`` on ``n`` ranks (behind ``prefix``, e.g. ``setpriv ...``); a job that
    outlives ``timeout`` is killed and fails. ``warm=False`` starts each rank's Python as
    itself, for what the warm start leaves out (the interpreter's own teardown)."""
    full_env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    py = python() if warm else [sys.executable]
    cmd = [*(prefix or []), *mpiexec(), "-n", str(n), *py, *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s\n{e.stdout}\n{e.stderr}")
    return Job(p.args, p.returncode, p.stdout, p.stderr)


def train(n: int, root: Path, steps: int, out: Path | None = None, *, every: int = 5,
          keep: int = 3, fault: str | None = None, extra: list[str] | None = None,
          timeout: float = 180) -> Job:
    """Run examples/train.py on ``n`` ranks."""
    args = [str(TRAIN), "--root", str(root), "--steps", str(steps), "--every", str(every),
            "--keep", str(keep), "--width", "64", *(extra or [])]
    if out is not None:
        args += ["--out", str(out)]
    return run_mpi(n, args, env={"MPICKPT_FAULT": fault} if fault else None, timeout=timeout)


def assert_same_final(a: Path, b: Path, n: int) -> None:
    """Each rank's final parameters and optimizer state in ``a`` equal those in ``b``, bitwise."""
    for r in range(n):
        x = torch.load(a / f"rank-{r}.pt", weights_only=True)
        y = torch.load(b / f"rank-{r}.pt", weights_only=True)
        for k, v in x["model"].items():
            assert torch.equal(v, y["model"][k]), f"rank {r}: parameter {k} differs"
        for pid, st in x["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, y["optim"]["state"][pid][k]), f"rank {r}: optim {pid}/{k}"


# ------------------------------------------------------------- the checkpoint tree under a ROOT


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def shard(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.h5"


def manifest(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / "MANIFEST.json").read_text())


def flip_data_byte(root: Path, step: int, rank: int) -> tuple[Path, str]:
    """Flip every bit of one byte in the middle of rank ``rank``'s largest tensor's data; return
    the shard and the tensor's name. The size stays: only a checksum can tell."""
    entry = manifest(root, step)["ranks"][rank]
    rec = max(entry["tensors"], key=lambda t: t["nbytes"])
    assert rec["nbytes"] > 0
    path = shard(root, step, rank)
    where = rec["offset"] + rec["nbytes"] // 2
    with open(path, "r+b") as f:
        f.seek(where)
        old = f.read(1)
        f.seek(where)
        f.write(bytes([old[0] ^ 0xFF]))
    assert path.stat().st_size == entry["bytes"]
    return path, rec["name"]


def starts(out: Path, n: int) -> list[int]:
    """The step each rank of examples/train.py --out OUT resumed from (0 for a fresh start)."""
    return [json.loads((out / f"rank-{r}.json").read_text())["start"] for r in range(n)]


@contextlib.contextmanager
def never_blocks(what: str, seconds: int = 10) -> Iterator[None]:
    """Fail the test if the block takes ``seconds`` (a reader that waits on a FIFO forever)."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"{what} blocked"))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def assert_restored_whole(out: Path, n: int, step: int, saved_by: int) -> None:
    """A resume scenario's report (``out/restored-N.json``) on ``n`` ranks: it restored
    ``step``, saved by ``saved_by`` ranks, and every tensor of the model and the optimizer in
    ``out/reference.pt`` came back equal."""
    got = json.loads((out / f"restored-{n}.json").read_text())
    assert (got["restored"], got["step"], got["saved_by"]) == (step, step, saved_by)
    ref = torch.load(out / "reference.pt", weights_only=True)
    assert set(got["same"]) == {f"model/{k}" for k in ref["model"]} | {
        f"optim/{k}/{s}" for k, st in ref["optim"].items() for s in st}
    differ = [k for k, same in got["same"].items() if not same]
    assert not differ, f"restored on {n} ranks, these differ from the saved tensors: {differ}"


MPICH_SEGMENTS = "/dev/shm/mpich_shm_*"


def orphan_segments(paths: set[str], min_age_s: float = 5.0) -> list[str]:
    """Of ``paths`` (MPICH's shared-memory segments), this user's that no process maps and none has
    touched for ``min_age_s``: left by ranks that were killed before MPICH unlinked them (the
    fault tests kill ranks by design). Each holds memory until it is removed; thousands of
    them from repeated runs filled a 24 GiB machine's RAM and the suite's workers died."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
    now = time.time()
    out = []
    for p in sorted(paths):
        with contextlib.suppress(OSError):
            st = os.stat(p)  # (only this user's: another's processes' maps are not readable)
            if p not in mapped and st.st_uid == os.getuid() and now - st.st_mtime >= min_age_s:
                out.append(p)
    return out


@contextlib.contextmanager
def job_holding(root: Path) -> Iterator[int]:
    """Another process holding ROOT's writer lock, as a saving job's rank 0 does; its pid."""
    hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('HELD', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", hold, str(root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    try:
        assert p.stdout.readline().strip() == "HELD"
        yield p.pid
    finally:
        p.stdin.close()
        assert p.wait(timeout=60) == 0
