"""The scenarios' own view of the job, under mpiexec (MPI) or torchrun (torch.distributed over
gloo, the training's default group, which mpickpt never uses), or one process that no launcher
started: rank, size, a barrier."""

from __future__ import annotations

from mpickpt.mpi.backend import backend


class World:
    """``rank``, ``size`` and ``barrier()`` of the job, over whichever launcher started it."""

    def __init__(self) -> None:
        chosen = backend()
        self.mpi = chosen == "mpi"
        self.alone = chosen == "self"  # one process that no launcher started
        if self.alone:
            self.rank, self.size = 0, 1
        elif self.mpi:
            from mpi4py import MPI

            self._comm = MPI.COMM_WORLD
            self.rank, self.size = self._comm.rank, self._comm.size
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        if self.alone:
            return
        if self.mpi:
            self._comm.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier()
