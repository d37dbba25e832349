"""What mpickpt takes from Slurm, in one place; each function reads the environment it is given,
so tests drive it by setting variables.

* When the job will be killed: ``$MPICKPT_DEADLINE``, else ``$SLURM_JOB_END_TIME`` (Unix seconds).
* Whether to requeue after a preemption: under Slurm (``$SLURM_JOB_ID``) unless
  ``$MPICKPT_REQUEUE`` is 0 (the job template requeues from its batch shell instead).
* How: ``scontrol requeue $SLURM_JOB_ID``, once, by rank 0.
* When the ranks can take a preemption signal: rank 0 creates ``$MPICKPT_READY_FILE`` (the job
  template's), so that the batch shell forwards an early signal then, not before.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping

from . import knobs


def job_end(env: Mapping[str, str] = os.environ) -> float | None:
    """Unix time at which the job will be killed, if known."""
    value = knobs.DEADLINE.get(env)
    if value is not None:
        return value
    raw = env.get("SLURM_JOB_END_TIME")
    return float(raw) if raw else None


def requeues(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a preempted job requeues itself by default."""
    return "SLURM_JOB_ID" in env and knobs.REQUEUE.get(env)


def requeue(log: logging.Logger, env: Mapping[str, str] = os.environ) -> bool:
    """``scontrol requeue`` this job (rank 0, once); whether it was requeued."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        p = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as e:
        log.error("cannot run scontrol requeue %s: %s; the job is not requeued", job, e)
        return False
    if p.returncode == 0:
        log.warning("requeued Slurm job %s", job)
        return True
    log.error("scontrol requeue %s failed (exit %d): %s", job, p.returncode, p.stderr.strip())
    return False


def say_ready(log: logging.Logger, env: Mapping[str, str] = os.environ) -> None:
    """Rank 0, once every rank watches the preemption signals: create ``$MPICKPT_READY_FILE``
    (if set). A failure is logged: the batch shell then holds an early signal for its limit."""
    path = knobs.READY_FILE.get(env)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"pid={os.getpid()}\n")
    except OSError as e:
        log.warning("cannot create MPICKPT_READY_FILE=%s: %s; an early preemption signal is "
                    "held by the batch shell until the limit of its hold instead", path, e)
