"""Which tensors the optimizers and modules in a state change: what the snapshot's hooks guard
(:meth:`mpickpt.save.snapshot.Snapshotter.guard`), and which CPU tensors it may copy lazily."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..sharding import local_tensor


def owned_by(opt: torch.optim.Optimizer, out: dict[int, int], guarded: set[int]) -> None:
    """The tensors that ``opt.step()`` changes, its parameters and its state: the CPU ones into
    ``out`` (data pointer -> bytes), every one's data pointer into ``guarded``."""
    def add(t: Any) -> None:
        t = local_tensor(t)
        if not isinstance(t, torch.Tensor):
            return
        guarded.add(t.data_ptr())
        if t.device.type == "cpu":
            out[t.data_ptr()] = max(out.get(t.data_ptr(), 0), t.numel() * t.element_size())
    for group in opt.param_groups:
        for p in group["params"]:
            add(p)
    for st in opt.state.values():
        for v in st.values():
            add(v)


def buffer_ptrs(m: torch.nn.Module) -> Iterator[int]:
    """The data pointers of a module's buffers (its submodules' too): what its forward pass
    changes. Not its parameters: an optimizer changes those, maybe before the next forward."""
    for t in m.buffers():
        yield local_tensor(t).data_ptr()
