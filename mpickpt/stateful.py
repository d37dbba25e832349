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


def misfit(stored_class: Any, live: Any, stored: Any, mine: Mapping[str, Any]) -> str | None:
    """Why the state dict of a ``stored_class`` object, as its stored tree node ``stored`` holds
    it, cannot be loaded into ``live`` (whose own state dict is ``mine``) without a partial or
    silently wrong restore, or None. Modules are checked key by key already; any other object
    must be of the class it was saved from (an SGD takes an Adam's state without a word), and an
    optimizer's parameter groups must hold as many parameters each (its ``load_state_dict``
    raises that only once the rest of the state has been restored)."""
    if isinstance(live, torch.nn.Module):
        return None
    kind = type(live)
    if isinstance(stored_class, str) and stored_class != f"{kind.__module__}.{kind.__qualname__}" \
            and not stored_class.endswith(f".{kind.__qualname__}"):
        return (f"checkpoint holds the state of a {stored_class}, the state has a "
                f"{kind.__module__}.{kind.__qualname__}: restore it into an object of the class "
                "it was saved from")
    if isinstance(live, torch.optim.Optimizer):
        groups = mine.get("param_groups")
        want = [len(g["params"]) for g in groups] if isinstance(groups, list) else None
        have = _group_sizes(stored)
        if have is not None and have != want:
            return (f"checkpoint holds an optimizer with parameter groups of {have} "
                    f"parameters, the state's has {want}")
    return None


def _group_sizes(node: Any) -> list[int] | None:
    """The number of parameters of each group of an optimizer's state dict, read from its stored
    tree node (a dict node whose ``param_groups`` item is a list of dict nodes with ``params``
    lists); None where the node is not so."""
    def item(n: Any, key: str) -> Any:
        items = n.get("items") if isinstance(n, Mapping) else None
        return next((v for k, v in items if k == key), None) if isinstance(items, list) and all(
            isinstance(i, list) and len(i) == 2 for i in items) else None
    groups = item(node, "param_groups")
    if not isinstance(groups, Mapping) or not isinstance(groups.get("items"), list):
        return None
    sizes = [item(g, "params") for g in groups["items"]]
    if not all(isinstance(p, Mapping) and isinstance(p.get("items"), list) for p in sizes):
        return None
    return [len(p["items"]) for p in sizes]
