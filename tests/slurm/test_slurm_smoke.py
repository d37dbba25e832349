"""Smoke test of the local Slurm: a 3-rank mpi4py job, launched by srun (PMI2) inside sbatch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PROGRAM = (
    "from mpi4py import MPI; c = MPI.COMM_WORLD; "
    "print('rank', c.rank, 'size', c.size, 'sum', c.allreduce(c.rank), flush=True)"
)


@pytest.mark.quick
def test_srun_mpi4py_three_ranks(slurm):
    out = slurm.workdir / "smoke.out"
    script = (
        "set -e\n"
        'echo "batch job $SLURM_JOB_ID ntasks $SLURM_NTASKS"\n'
        f'srun --mpi=pmi2 -K1 {sys.executable} -c "{PROGRAM}"\n'
    )
    jobid = slurm.sbatch(["-J", "smoke", "-n", "3", "--overcommit", "--time=5", "-o", str(out)],
                         script)
    state = slurm.wait(jobid, timeout=180)
    text = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {jobid} ended {state}\n{text}"
    lines = sorted(ln for ln in text.splitlines() if ln.startswith("rank "))
    assert lines == [f"rank {r} size 3 sum 3" for r in range(3)], text
    assert f"batch job {jobid} ntasks 3" in text


def test_a_clean_exit_3_stays_3_under_srun_K1_when_a_rank_is_slow_to_leave(slurm):
    """Every rank raises SystemExit(3) (a preempted job, after its checkpoint), and rank 1 takes
    2 s to leave after MPI_Finalize. srun -K1 SIGTERMs it as soon as rank 0 has exited with 3;
    the job must still end with 3 (not 143, which the template takes for a failure)."""
    repo = Path(__file__).resolve().parents[2]
    out = slurm.workdir / "linger.out"
    script = (
        f"srun --mpi=pmi2 -K1 {sys.executable} -m mpickpt.run "
        f"{repo / 'tests' / 'scenarios' / 'run_exit.py'} 3\n"
        'echo "srun exit $?"\n'
    )
    jobid = slurm.sbatch(["-J", "linger", "-n", "2", "--overcommit", "--time=5", "-o", str(out)],
                         script, env={"RUN_EXIT_LINGER": "1:2"})
    slurm.wait(jobid, timeout=180)
    text = out.read_text() if out.exists() else "(no output file)"
    assert "srun exit 3" in text, text
    assert "rank 0 left" in text and "rank 1 left" in text, text
