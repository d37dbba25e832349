"""The user metadata of a save: checked on the calling thread, made JSON on the background one.

``save(step, state, metadata={...})`` takes JSON values: str keys; None, bool, int, float, str,
and lists, tuples and dicts of them. A 0-d tensor or a numpy scalar counts as its number: a CPU
one is read at once, a CUDA one is copied on the GPU and read by the background thread once the
copy has landed, so the training loop never waits for the device. NaN and the infinities, which
JSON has no numbers for, are stored as the strings ``"nan"``, ``"inf"`` and ``"-inf"``. Anything
else raises :class:`~mpickpt.errors.MetadataError` naming its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import MetadataError


class _OnDevice:
    """A CUDA scalar copied on its stream; :meth:`value` waits for the copy, on another thread."""

    def __init__(self, t: torch.Tensor) -> None:
        self.copy = t.detach().clone()
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(t.device))

    def value(self) -> Any:
        self.event.synchronize()
        return _number(self.copy.item())


def _number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _where(path: tuple[Any, ...]) -> str:
    return "metadata" + "".join(f"[{k!r}]" for k in path)


def check(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``metadata`` that :func:`resolve` turns into JSON values; MetadataError for a
    value that cannot be, naming its key."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise MetadataError(f"metadata must be a dict, not {type(metadata).__name__}")
    return _check(metadata, ())


def _check(x: Any, path: tuple[Any, ...]) -> Any:
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return _number(x)
    if isinstance(x, Mapping):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise MetadataError(f"{_where(path)}: key {k!r} of type {type(k).__name__} "
                                    "cannot be saved; metadata keys must be str")
            out[k] = _check(v, (*path, k))
        return out
    if isinstance(x, (list, tuple)):
        return [_check(v, (*path, i)) for i, v in enumerate(x)]
    if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_complex() and x.numel() == 1:
        return _OnDevice(x) if x.is_cuda else _number(x.item())
    if isinstance(x, (np.generic, np.ndarray)) and x.ndim == 0 and x.dtype.kind in "biuf":
        return _number(x.item())
    what = type(x).__name__
    if isinstance(x, (torch.Tensor, np.ndarray)):
        what += f" of shape {list(x.shape)} and dtype {x.dtype}"
    raise MetadataError(
        f"{_where(path)}: cannot save a value of type {what}; metadata values must be JSON: "
        "numbers, strings, bools, None, and lists or dicts of them (a 0-d tensor or numpy "
        "scalar counts as its number)")


def resolve(x: Any) -> Any:
    """The JSON value of what :func:`check` returned (waits for CUDA scalars' copies)."""
    if isinstance(x, _OnDevice):
        return x.value()
    if isinstance(x, dict):
        return {k: resolve(v) for k, v in x.items()}
    if isinstance(x, list):
        return [resolve(v) for v in x]
    return x
