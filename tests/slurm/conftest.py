"""A real one-node Slurm for tests: ``launch/slurm-local up`` once per session, ``down`` at its end.

The ``slurm`` fixture skips (with the script's output as the reason) when Slurm cannot be
installed or started here, e.g. not root or apt-get failing; with MPICKPT_REQUIRE_SLURM=1 it
fails instead. MPICKPT_SLURM_KEEP=1 leaves the daemons running after the session.
See the notes at the top of launch/slurm-local for the timings and gotchas of this Slurm.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "slurm-local"

# Job states after which a job never runs again (a requeued job goes back to PENDING instead).
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ less an enclosing job's SLURM_*/PMI_* (SLURM_LOCAL_* stay), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k.startswith("SLURM_LOCAL_")
           or not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_"))}
    env.update(extra or {})
    return env


class Slurm:
    """Helpers around sbatch/scontrol for the one-node cluster that launch/slurm-local runs."""

    def __init__(self, workdir: Path, status: str) -> None:
        self.workdir = workdir  # default working directory of jobs (slurm-%j.out lands here)
        self.status = status  # the one-line status printed by `launch/slurm-local up`
        conf = self._run(["scontrol", "show", "config"]).stdout
        m = re.search(r"^JobCompLoc\s*=\s*(\S+)", conf, re.M)
        self.jobcomp = Path(m.group(1)) if m else None  # final states of purged jobs
        self._n = 0

    @staticmethod
    def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env or _clean_env(),
                           cwd=cwd, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout}{p.stderr}")
        return p

    def sbatch(self, args: list[str], script: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """Submit ``script`` (a bash script unless it has its own #!) with sbatch ARGS; the job id.

        ``env`` is added to sbatch's environment, which the job inherits (--export=ALL).
        Jobs run in ``cwd`` (default: self.workdir), where slurm-%j.out lands without -o.
        """
        self._n += 1
        path = self.workdir / f"job-{self._n}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        path.chmod(0o755)
        p = self._run(["sbatch", "--parsable", *args, str(path)], env=_clean_env(env),
                      cwd=cwd or self.workdir)
        return p.stdout.strip().split(";")[0]

    def show(self, jobid: str) -> dict[str, str]:
        """``scontrol show job`` as a dict; empty once the job is purged (MinJobAge after end)."""
        p = self._run(["scontrol", "show", "job", "-o", str(jobid)], check=False)
        if p.returncode != 0 or "JobId=" not in p.stdout:
            return {}
        line = p.stdout.splitlines()[0]
        return dict(re.findall(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)", line))

    def state(self, jobid: str) -> str | None:
        """The job's state (PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, TIMEOUT, ...).

        For a job that slurmctld has already purged, its last record in the jobcomp log;
        None if Slurm never heard of it.
        """
        info = self.show(jobid)
        if info:
            return info.get("JobState")
        if self.jobcomp and self.jobcomp.exists():
            last = None
            for line in self.jobcomp.read_text().splitlines():
                if line.startswith(f"JobId={jobid} "):
                    m = re.search(r"\bJobState=(\S+)", line)
                    last = m.group(1) if m else last
            return last
        return None

    def wait(self, jobid: str, timeout: float = 120) -> str:
        """Wait for a final state and return it; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = self.state(jobid)
            if st in FINAL_STATES:
                return st
            time.sleep(0.5)
        info = self._run(["scontrol", "show", "job", str(jobid)], check=False)
        raise TimeoutError(f"job {jobid} still {st} after {timeout} s\n{info.stdout}{info.stderr}")

    def cancel(self, jobid: str, *args: str) -> None:
        """scancel ARGS JOBID (e.g. "--signal=USR2", "-b")."""
        self._run(["scancel", *args, str(jobid)])


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """A running one-node Slurm, or a skip that says why there is none."""
    try:
        p = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=900,
                           stdin=subprocess.DEVNULL, env=_clean_env())
        out, rc = (p.stdout + p.stderr).strip(), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timed out after 900 s: {e.stdout or ''}{e.stderr or ''}", -1
    if rc != 0:
        reason = f"launch/slurm-local up exited {rc}: {out}"
        if os.environ.get("MPICKPT_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield Slurm(tmp_path_factory.mktemp("slurm"), out.splitlines()[-1] if out else "")
    finally:
        if os.environ.get("MPICKPT_SLURM_KEEP") != "1":
            subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, env=_clean_env())
