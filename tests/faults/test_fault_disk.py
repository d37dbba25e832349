"""Full-disk, read-only and permission faults under ROOT, on real file systems.

Each case (tests/scenarios/fault_disk.py): steps 5 and 10 commit, the save of step 15 fails on
every rank because of the file system, the fault is repaired, step 20 commits; then steps 20, 10
and 5 restore bit for bit, and a restart leaves no partial directory behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import committed_steps, partials, reports, step_dirs
from harness import NO_DAC, SCENARIOS, Job, mpiexec, python

from mpickpt.format import rootdir
from mpickpt.format.names import RANK_FILE_RE

N = 2
pytestmark = pytest.mark.guarantee("failed-save-aborts")
SCENARIO = str(SCENARIOS / "fault_disk.py")


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points to unmount at the end of the test."""
    done: list[Path] = []
    yield done
    for m in reversed(done):
        subprocess.run(["umount", "-l", str(m)], check=True)


def launch(args: list[str], prefix: list[str] | None = None, timeout: float = 120) -> Job:
    """``python ARGS`` on N ranks behind ``prefix`` (e.g. setpriv); a job killed at ``timeout``
    has ``returncode`` None (a hang, which the case records before failing)."""
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [*(prefix or []), *mpiexec(), "-n", str(N), *python(), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Job(cmd, None, out, f"{err}\n[killed after {timeout} s]")
    return Job(cmd, p.returncode, out, err)


def run_scenario(root: Path, mode: str, reports_dir: Path, prefix: list[str] | None = None
                 ) -> tuple[Job, dict[int, dict]]:
    job = launch([SCENARIO, str(root), mode, str(reports_dir)], prefix)
    return job, reports(reports_dir)


def restart(root: Path, reports_dir: Path, steps: list[int]) -> tuple[Job, list[str]]:
    """A new job's Checkpointer and restore (tests/scenarios/fault_restore.py) must restore the
    newest of ``steps`` on every rank and leave exactly ``steps`` under ROOT (and the pool of
    retired rank shards), nothing partial or half-deleted; the job and what went wrong."""
    job = launch([str(SCENARIOS / "fault_restore.py"), str(root), str(reports_dir),
                  "--width", "256"])
    found = reports(reports_dir)
    if job.returncode != 0 or sorted(found) != list(range(N)):
        return job, [f"the restart failed (exit {job.returncode}):\n{job.output}"]
    out = [f"rank {r}: the restart restored {rep['step']} ({rep['error']})"
           for r, rep in sorted(found.items()) if rep["step"] != steps[-1]]
    names = sorted(p.name for p in root.iterdir())
    pool = root / rootdir.POOL
    pooled = sorted(p.name for p in pool.iterdir()) if rootdir.POOL in names else []
    if [n for n in names if n != rootdir.POOL] != ["stats.jsonl",
                                                     *(f"step-{s:08d}" for s in steps)] \
            or not all(RANK_FILE_RE.match(n) for n in pooled):
        out.append(f"after the restart ROOT holds {names}, its pool {pooled}")
    return job, out


def problems(root: Path, job: Job, found: dict[int, dict], why: str) -> list[str]:
    """What went wrong in a fault_disk.py run, as sentences (none: the case held)."""
    out = []
    if job.returncode != 0:
        return [f"the job failed (exit {job.returncode}):\n{job.output}"]
    if sorted(found) != list(range(N)):
        return [f"reports from ranks {sorted(found)} only:\n{job.output}"]
    errors = {found[r]["saves"]["15"]["error"] for r in range(N)}
    for r, rep in found.items():
        saves = rep["saves"]
        for s in ("5", "10", "20"):
            if not saves[s]["committed"]:
                out.append(f"rank {r}: step {s} not committed: {saves[s]['error']}")
        failed = saves["15"]
        if failed["committed"] or failed["path"] is not None:
            out.append(f"rank {r}: step 15 committed: {failed}")
        elif not failed["error"] or why not in failed["error"]:
            out.append(f"rank {r}: step 15's error does not say {why!r}: {failed['error']}")
        partial = str(root / "step-00000015.partial-")
        if not failed["error"] or "rank " not in failed["error"] or partial not in failed["error"]:
            out.append(f"rank {r}: step 15's error names no rank or no {partial}*: "
                       f"{failed['error']}")
        if f"[mpickpt rank {r}] ERROR checkpoint of step 15 aborted on all ranks" not in job.stderr:
            out.append(f"rank {r} did not log the abort")
        if rep["fds"][0] != rep["fds"][1]:
            out.append(f"rank {r}: {rep['fds'][0]} open files before the failed save, "
                       f"{rep['fds'][1]} after the next one")
        if rep["restored"] != [[20, True], [10, True], [5, True]]:
            out.append(f"rank {r}: restores of 20, 10, 5 gave {rep['restored']}")
    if len(errors) != 1:
        out.append(f"the ranks give different reasons: {errors}")
    after = [n for n in found[0]["after_abort"] if n != "stats.jsonl"]
    if after != ["step-00000005", "step-00000010"]:
        out.append(f"after the abort ROOT held {found[0]['after_abort']}")
    if committed_steps(root) != [5, 10, 20] or partials(root):
        out.append(f"at the end ROOT holds {step_dirs(root)}")
    return out


def record(guarantees, case: str, bad: list[str], *jobs: Job) -> None:
    """Count the case: a hang when a job had to be killed, else failed when anything is bad."""
    hung = any(job.returncode is None for job in jobs)
    guarantees.record("disk", case, "hang" if hung else "failed" if bad else "correct",
                      "; ".join(bad)[:2000])


def test_enospc_mid_write_then_space_returns(tmp_path, mounts, guarantees):
    fs = tmp_path / "fs"
    mount_tmpfs(fs, "16m")
    mounts.append(fs)
    root = fs / "ckpt"
    job, found = run_scenario(root, "enospc", tmp_path / "reports")
    bad = problems(root, job, found, "[Errno 28] No space left on device: '")
    facts = found.get(0, {}).get("facts", {})
    if not 0 < facts.get("free", 0) < facts.get("shard_bytes", 0):
        bad.append(f"not a mid-write failure: {facts}: the free bytes must be fewer than a shard's")
    if (fs / "ballast").exists():
        bad.append("the ballast is still there")
    again, worse = restart(root, tmp_path / "restart", [5, 10, 20])
    bad += worse
    record(guarantees, "ENOSPC mid-write, then space returns", bad, job, again)
    assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_read_only_root(tmp_path, mounts, guarantees):
    """ROOT remounted read-only between saves; then a job started on a read-only ROOT (holding a
    dead run's partial directory) restores, and its save aborts on every rank; the leftover goes
    at the first start with ROOT writable again."""
    root = tmp_path / "ckpt"
    mount_tmpfs(root, "64m")
    mounts.append(root)
    job, found = run_scenario(root, "readonly", tmp_path / "reports")
    bad = problems(root, job, found, "[Errno 30] Read-only file system: '")
    record(guarantees, "ROOT remounted read-only between saves", bad, job)
    assert not bad, "\n".join(bad)

    leftover = root / "step-00000025.partial-0123456789ab"
    leftover.mkdir()
    (leftover / "rank-00000.h5").write_bytes(b"\0" * 4096)
    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    ro = launch([SCENARIO, str(root), "ro-restore", str(tmp_path / "ro")])
    got = reports(tmp_path / "ro")
    if ro.returncode != 0 or sorted(got) != list(range(N)):
        bad.append(f"the job on the read-only ROOT failed (exit {ro.returncode}):\n{ro.output}")
    else:
        for r, rep in sorted(got.items()):
            if rep["restored"] != [20, True]:
                bad.append(f"rank {r}: restore from the read-only ROOT gave {rep['restored']}")
            save = rep["save"]
            partial = f"[Errno 30] Read-only file system: '{root}/step-00000025.partial-"
            if save["committed"] or partial not in (save["error"] or ""):
                bad.append(f"rank {r}: save of step 25 on the read-only ROOT: {save}")
        if len({rep["save"]["error"] for rep in got.values()}) != 1:
            bad.append("the ranks give different reasons for the failed save of step 25")
        if f"could not remove {leftover}" not in ro.stderr:
            bad.append(f"no warning about the leftover it could not remove:\n{ro.stderr}")
    subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
    if not leftover.exists():
        bad.append("the leftover vanished from a read-only file system")
    again, worse = restart(root, tmp_path / "restart", [5, 10, 20])
    bad += worse
    record(guarantees, "restore from a read-only ROOT", bad, ro, again)
    assert not bad, "\n".join(bad)


def test_root_without_write_permission(tmp_path, guarantees):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    root = tmp_path / "ckpt"
    job, found = run_scenario(root, "perm", tmp_path / "reports", prefix=["setpriv", *NO_DAC])
    bad = problems(root, job, found, "[Errno 13] Permission denied: '")
    again, worse = restart(root, tmp_path / "restart", [5, 10, 20])
    bad += worse
    record(guarantees, "ROOT without write permission", bad, job, again)
    assert not bad, "\n".join(bad)


def test_retention_and_stats_without_write_permission(tmp_path, guarantees):
    """After a commit, rank 0 can neither delete the oldest checkpoint (its directory is 0555)
    nor append to stats.jsonl (0444): the save stays committed on every rank, rank 0 warns, and
    training and later saves go on; a restart removes what retention left."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    root = tmp_path / "ckpt"
    job, found = run_scenario(root, "retention-perm", tmp_path / "reports",
                              prefix=["setpriv", *NO_DAC])
    bad = []
    if job.returncode != 0 or sorted(found) != list(range(N)):
        bad.append(f"the job failed (exit {job.returncode}):\n{job.output}")
    else:
        for r, rep in sorted(found.items()):
            for s, res in rep["saves"].items():
                if not res["committed"]:
                    bad.append(f"rank {r}: step {s} not committed: {res['error']}")
            if rep["restored"] != [[20, True], [15, True]]:
                bad.append(f"rank {r}: restores of 20 and 15 gave {rep['restored']}")
        for what in ("step-00000005", "stats.jsonl"):
            if not any("WARNING" in line and what in line and "Permission denied" in line
                       for line in job.stderr.splitlines()):
                bad.append(f"rank 0 gave no warning naming {what} and the error:\n{job.stderr}")
        steps = [json.loads(line)["step"] for line in (root / "stats.jsonl").open()]
        if steps != [5, 10, 20]:
            bad.append(f"stats.jsonl holds steps {steps}")
    again, worse = restart(root, tmp_path / "restart", [15, 20])
    bad += worse
    record(guarantees, "retention and stats.jsonl without write permission", bad, job, again)
    assert not bad, "\n".join(bad)
