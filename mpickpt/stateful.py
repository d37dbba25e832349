"""Objects to put in a state when what must be saved is not already an object with
``state_dict()``: :class:`RNGState` (the process-wide random generators) and :class:`Values`
(plain values restored in place). :mod:`mpickpt.format.state_tree` saves them like any stateful
object.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


class RNGState:
    """The process-wide RNG states (Python ``random``, NumPy's legacy global, torch CPU and CUDA).

    Put an instance in the state (``state["rng"] = mpickpt.RNGState()``) to make a resumed run draw
    the same random numbers as an uninterrupted one.
    """

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "python": py_state(random.getstate()),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        random.setstate(py_unstate(sd["python"]))
        np.random.set_state(tuple(sd["numpy"]))
        torch.set_rng_state(sd["torch"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(sd["cuda"]))


class Values:
    """Plain values restored in place: ``progress = mpickpt.Values(epoch=0, seen=0)`` in the
    state, ``progress.epoch += 1`` in the loop. A restore sets the attributes of this very
    object, so every reference to it sees the restored values (a plain ``"epoch": 0`` in the
    state dict is replaced in the dict, not in the variable it came from). Values are whatever a
    state may hold: numbers, strings, tensors, lists and dicts of them."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.__dict__.update(sd)

    def __repr__(self) -> str:
        return f"Values({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def py_state(state: tuple[Any, ...]) -> dict[str, Any]:
    """``random.getstate()`` with its 625 words as one uint32 array instead of 625 JSON nodes."""
    version, words, gauss = state
    return {"version": version, "words": np.asarray(words, dtype=np.uint32), "gauss": gauss}


def py_unstate(d: Mapping[str, Any]) -> tuple[Any, ...]:
    return (int(d["version"]), tuple(int(w) for w in d["words"]), d["gauss"])

