"""Which :class:`~mpickpt.mpi.comm.Comm` a job's protocol takes (MPI, gloo, or none for a
process alone), the job's own communicator on it, this process's rank, and the end of the whole
job. Imports neither MPI nor torch until a job needs one of them."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from .. import knobs
from .comm import Comm

# set by the MPI launchers we know (Open MPI, MPICH's hydra, PMI-2/PMIx under srun --mpi=,
# MVAPICH, Intel MPI, HPE Cray's PALS and ALPS): a job started by one of them speaks MPI
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "PMI_FD",
                     "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDI_CONTROL_FD",
                     "PALS_RANKID", "ALPS_APP_PE")
TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# any of them: some launcher placed this process among others
PEER_VARS = (*TORCH_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def alone(env: dict[str, str]) -> bool:
    """Whether nothing says this process has peers: no launcher's variables (MPI's, torch's),
    no Slurm step of several tasks (``srun`` without ``--mpi=``: MPI would not see the others
    either, but MPI is what such a job means), and no ``torch.distributed`` group of several
    ranks already up (workers a script spawned itself)."""
    if any(v in env for v in (*MPI_LAUNCHER_VARS, *PEER_VARS)):
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        return False
    try:
        return int(env.get("SLURM_STEP_NUM_TASKS") or 1) <= 1
    except ValueError:
        return False


def mpi_loads() -> bool:
    """Whether mpi4py's MPI can be imported here (initialising MPI if it was not)."""
    try:
        from mpi4py import MPI  # noqa: F401  (mpi4py's wheel without an MPI library: RuntimeError)
    except (ImportError, RuntimeError):
        return False
    return True


def backend(env: dict[str, str] | None = None) -> str:
    """"mpi", "torch" or "self": ``$MPICKPT_BACKEND`` when not "auto"; else MPI under an MPI
    launcher or where mpi4py is already initialised; else torch under torchrun (or any launcher
    that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: mpi4py initialised there sees one
    rank); else, for a process :func:`alone`, "self" (:mod:`~mpickpt.mpi.selfcomm`: no
    communication, MPI not started); else MPI where mpi4py's MPI loads, torch where it cannot
    (no mpi4py, or its wheel without an MPI library)."""
    env = dict(os.environ) if env is None else env
    chosen = knobs.BACKEND.get(env)
    if chosen != "auto":
        return chosen
    if any(v in env for v in MPI_LAUNCHER_VARS):
        return "mpi"
    if _mpi_initialized() and sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size() > 1:
        return "mpi"  # (a launcher we do not know)
    if all(v in env for v in TORCH_VARS):
        return "torch"
    if _mpi_initialized():
        return "mpi"
    if alone(env):
        return "self"
    return "mpi" if mpi_loads() else "torch"


def open_comm(comm: Any = None) -> Comm:
    """``comm`` (an mpi4py communicator, or a :class:`Comm`), else the whole job over
    :func:`backend`'s choice. Not a copy: :class:`~mpickpt.mpi.protocol.Protocol` dups it."""
    if comm is not None and hasattr(comm, "node_keys"):
        return comm
    chosen = "mpi" if comm is not None else backend()
    if chosen == "mpi":
        from .mpicomm import MpiComm, world

        return MpiComm(comm if comm is not None else world())
    if chosen == "self":
        from .selfcomm import world as self_world

        return self_world()
    from .torchcomm import world as torch_world

    return torch_world()


def world_rank() -> int | None:
    """This process's rank in the job, or None before the job's communication is set up (MPI
    not initialised, no torch launcher's RANK)."""
    if _mpi_initialized():
        return int(sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank())
    from . import selfcomm, torchcomm

    return 0 if selfcomm.opened() else torchcomm.opened_rank()


def abort_world(code: int) -> NoReturn:
    """End every rank of the job with exit code ``code``. Under MPI: ``MPI_Abort`` on
    ``MPI_COMM_WORLD``, then this process's own end: MPICH's ``MPI_Abort`` can return to the
    caller while the launcher tears the job down (the mpich wheel with hydra: about one call in
    two), and what ran next (an uncaught exception's ``abort(1)``) could win the race for the
    job's exit code; ``os._exit`` makes sure nothing does. Without MPI this process ends with
    ``code``: its launcher (torchrun's agent) sees a worker fail and ends the others, and the
    ranks waiting on it in a collective see the broken connection at once and abort too."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _mpi_initialized():
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
    os._exit(code)
