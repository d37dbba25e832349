"""DDP training on CPU with gloo, checkpointed with mpickpt; run under
``mpiexec -n N python -m mpickpt.run ddp_train.py MODE ...`` (modes and outputs as in
fsdp_train.py, whose training loop this shares).

Every rank holds the whole model and optimizer state alike, so the Checkpointer is told so
(``replicated=("model", "optim")``): each tensor is written once, by one rank, the tensors spread
over the ranks. The state comes from ``get_state_dict(model, optim)`` as for FSDP - what PyTorch
recommends for any wrapped model: it takes the keys without DDP's ``module.`` prefix (so the
checkpoint also loads into an unwrapped model) and names the optimizer state by parameter name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from fsdp_train import main
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(model: torch.nn.Sequential, world: int) -> torch.nn.Module:
    assert dist.get_world_size() == world
    return DistributedDataParallel(model)


if __name__ == "__main__":
    main(wrap_ddp, replicated=("model", "optim"))
