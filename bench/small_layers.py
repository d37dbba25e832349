"""The state the probes of many small tensors share (``probe_gc.py``, ``probe_gc_share.py``,
``probe_restore_many.py``): ``layers`` ``Linear(width, width)`` layers and their Adam state
after one step, 8 tensors a layer. Not a benchmark of its own."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def small_layers(layers: int, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                         int]:
    """(model, optimizer, the number of tensors in their state dicts), seeded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    tensors = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    return model, opt, tensors


def write_rows(path: str, args: Any, tensors: int, rows: list[dict[str, Any]]) -> None:
    """A probe's JSON: its arguments, the state's tensor count, torch's version, its rows."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"args": vars(args), "tensors": tensors, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    print(f"wrote {path}")
