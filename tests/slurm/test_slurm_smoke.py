"""Smoke test of the local Slurm: a 3-rank mpi4py job, launched by srun (PMI2) inside sbatch."""

from __future__ import annotations

import sys

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
