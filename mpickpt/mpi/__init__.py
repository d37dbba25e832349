"""The protocol layer: every collective with a deadline on a private communicator, the roll call
when one is missed, the exit vote. With :mod:`mpickpt.run`, the only code that talks MPI (or,
under torchrun without MPI, gloo: :mod:`mpickpt.mpi.backend`)."""

from __future__ import annotations

import os
import sys

CMA = "MPIR_CVAR_CH4_CMA_ENABLE"


def prefer_single_copy() -> bool:
    """Before MPI is initialised, ask MPICH to move large messages between the ranks of a node
    with one copy (Linux CMA: ``process_vm_readv``) instead of two through shared-memory cells
    (one 126 MB ``Sendrecv`` between two ranks of the development VM: 3.5 GB/s with two copies,
    8.7 GB/s with one; docs/performance.md). Not when the user set
    ``MPIR_CVAR_CH4_CMA_ENABLE``, nor where the
    kernel's ptrace rules (Yama ``ptrace_scope`` above 0) forbid it between sibling processes;
    other MPIs ignore the variable. Whether it was set here."""
    if "mpi4py.MPI" in sys.modules or CMA in os.environ:
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = "0"  # no Yama: ptrace within a user is allowed
    if scope != "0":
        return False
    os.environ[CMA] = "1"
    return True


prefer_single_copy()

from .backend import abort_world as abort_world  # noqa: E402  (re-exported)
