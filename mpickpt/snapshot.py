"""Snapshot: bring every tensor of a flattened state to contiguous host memory.

Synchronous for now: contiguous CPU tensors are used as they are (the save writes them before it
returns), others are copied. The asynchronous CUDA-stream snapshotter into a pinned pool replaces
this behind the same function.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors with the same names and values."""
    out = {}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            t = t.to("cpu")
        out[name] = t.contiguous()
    return out
