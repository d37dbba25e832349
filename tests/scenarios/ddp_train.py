"""DDP training on CPU with gloo, checkpointed with mpickpt; run under
``mpiexec -n N python -m mpickpt.run ddp_train.py MODE ...`` (modes and outputs as in
fsdp_train.py, whose training loop this shares).

Every rank holds the whole model and optimizer state alike, so the Checkpointer is told so
(``replicated=("model", "optim")``): each tensor is written once, by one rank, the tensors spread
over the ranks. The state comes from ``get_state_dict(model, optim)`` as for FSDP - what PyTorch
recommends for any wrapped model: it takes the keys without DDP's ``module.`` prefix (so the
checkpoint also loads into an unwrapped model) and names the optimizer state by parameter name.

DDP is built by :func:`ddp`, with ``find_unused_parameters=True`` so that a run resumed from a
checkpoint trains bit for bit like an uninterrupted one (tests/multirank/test_ddp.py).

Run by tests/multirank/test_ddp.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fsdp_train import main
from torch.nn.parallel import DistributedDataParallel


def ddp(model: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    # DDP rebuilds its gradient buckets after its first iteration, so a resumed run would sum some
    # step's gradients in another bucket layout (float order); with this it never rebuilds them.
    return DistributedDataParallel(model, find_unused_parameters=True, **kwargs)


def wrap_ddp(model: torch.nn.Sequential, world: int) -> torch.nn.Module:
    assert dist.get_world_size() == world
    return ddp(model)


if __name__ == "__main__":
    main(wrap_ddp, replicated=("model", "optim"))
