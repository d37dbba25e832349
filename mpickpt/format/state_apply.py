"""Apply a stored state tree (:mod:`.state_tree`) back into the live state, in place.

Applying is two-pass: :func:`apply` with ``dry_run=True`` checks the whole tree against the live
state and changes nothing, so a restore that would not fit fails before any tensor is touched; the
real pass then copies into existing tensors in place and calls ``load_state_dict``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import sharding
from ..errors import StateMismatchError
from ..stateful import py_unstate
from . import dtypes
from .state_tree import _path_str


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype name of a stored array, known before its bytes are read."""

    dtype: str
    shape: tuple[int, ...]



_SCALARS: dict[str, Callable[[Any], Any]] = {
    "none": lambda v: None,
    "bool": bool,
    "int": int,
    "str": str,
    "float": float,
    "bytes": bytes.fromhex,
    "torch_dtype": dtypes.torch_dtype,
}


class _Applier:
    """Walks a stored tree against the live state. ``arrays`` maps names to loaded tensors, or to
    :class:`ArraySpec` in a dry run."""

    def __init__(self, arrays: Mapping[str, torch.Tensor | ArraySpec], dry_run: bool,
                 borrowed: bool, keep: Collection[str] = (),
                 onto: Mapping[str, torch.device] | None = None) -> None:
        self.arrays = arrays
        self.dry = dry_run
        self.borrowed = borrowed  # arrays live in a reused buffer: copy what the state keeps
        self.keep = keep  # (but these, in memory of their own)
        self.onto = onto or {}  # the device of each array the state does not hold yet
        # Keys present in the state but absent from the checkpoint are an error, except inside the
        # state dict of a stateful object that is not a Module (an optimizer's state may be empty
        # before its first step; its load_state_dict() replaces it whole).
        self.strict = True

    def fail(self, path: tuple[Any, ...], msg: str) -> StateMismatchError:
        return StateMismatchError(f"state[{_path_str(path)}]: {msg}")

    def array(self, node: Mapping[str, Any], path: tuple[Any, ...]) -> torch.Tensor | ArraySpec:
        name = node.get("name")
        if name not in self.arrays:
            raise self.fail(path, f"the checkpoint references array {name!r} that it does not hold")
        return self.arrays[name]

    def node(self, node: Any, live: Any, path: tuple[Any, ...]) -> Any:
        if not isinstance(node, Mapping) or not isinstance(node.get("type"), str):
            raise self.fail(path, "malformed tree node in the checkpoint")
        kind = node["type"]
        handler = getattr(self, "n_" + kind, None)
        if handler is not None:
            return handler(node, live, path)
        if kind in _SCALARS:
            value = node.get("value")
            try:
                return _SCALARS[kind](value)
            except (TypeError, ValueError) as e:
                raise self.fail(path, f"bad {kind} value {value!r}: {e}") from None
        raise self.fail(path, f"unknown node type {kind!r} in the checkpoint")

    def n_dict(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        items = node.get("items")
        if not isinstance(items, list):
            raise self.fail(path, "malformed dict node in the checkpoint")
        if live is not None and not isinstance(live, Mapping):
            raise self.fail(path, f"checkpoint holds a dict, the state a {type(live).__name__}")
        stored_keys = [it[0] for it in items]
        if live is not None and self.strict:
            missing = [k for k in live if k not in stored_keys]
            if missing:
                raise self.fail(path, f"keys {missing!r} are in the state, not in the checkpoint")
        out = live if (live is not None and hasattr(live, "__setitem__")) else {}
        for key, child in items:
            cur = live.get(key) if live is not None else None
            value = self.node(child, cur, (*path, key))
            if not self.dry:
                out[key] = value
        return out

    def _seq(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> list[Any]:
        items = node.get("items")
        if not isinstance(items, list):
            raise self.fail(path, "malformed list node in the checkpoint")
        if not isinstance(live, (list, tuple)) or len(live) != len(items):
            live = [None] * len(items)
        pairs = enumerate(zip(items, live, strict=True))
        return [self.node(c, cur, (*path, i)) for i, (c, cur) in pairs]

    def n_list(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        values = self._seq(node, live, path)
        if isinstance(live, list) and len(live) == len(values):
            if not self.dry:
                live[:] = values
            return live
        return values

    def n_tuple(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        return tuple(self._seq(node, live, path))

    def n_tensor(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        src = self.array(node, path)
        target = sharding.local_tensor(live)  # a DTensor's or a Piece's local tensor
        if isinstance(target, torch.Tensor):
            want = ArraySpec(dtypes.name_of(target.dtype), tuple(target.shape))
            have = src if isinstance(src, ArraySpec) else _spec(src)
            if want != have:
                raise self.fail(
                    path,
                    f"checkpoint holds {have.dtype}{list(have.shape)}, "
                    f"the state {want.dtype}{list(want.shape)}",
                )
            if any(st == 0 and n > 1 for st, n in zip(target.stride(), target.shape,
                                                       strict=True)):
                raise self.fail(path, "the state's tensor is an expanded view (elements share "
                                "memory), which nothing can be copied into: give the state a "
                                "tensor of its own there (.clone() it)")
            if not self.dry:
                with torch.no_grad():
                    target.copy_(src, non_blocking=True)
            return live
        if self.dry:
            return src
        onto = self.onto.get(node.get("name", ""))
        if onto is not None and src.device != onto:
            return src.to(onto, non_blocking=True)  # (a tensor of its own)
        return src if not self.borrowed or node.get("name") in self.keep else src.clone()

    def n_ndarray(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        src = self.array(node, path)
        if self.dry:
            return src
        arr = src.numpy()
        if self.borrowed:
            arr = arr.copy()
        if node.get("scalar"):
            return arr[()]
        if isinstance(live, np.ndarray) and live.shape == arr.shape and \
                live.dtype == arr.dtype and live.flags.writeable:
            np.copyto(live, arr)
            return live
        return arr

    def n_torch_generator(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        src = self.array(node, path)
        gen = live if isinstance(live, torch.Generator) else None
        if not self.dry:
            if gen is None:
                gen = torch.Generator(device=node.get("device", "cpu"))
            gen.set_state(src.clone())  # set_state ignores a view's storage offset
        return gen

    def n_np_generator(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        state = self.node(node.get("state"), None, path)
        if self.dry:
            return live
        gen = live if isinstance(live, np.random.Generator) else None
        if gen is None:
            bitgen = getattr(np.random, str(state.get("bit_generator")), None)
            if not (isinstance(bitgen, type) and issubclass(bitgen, np.random.BitGenerator)):
                raise self.fail(path, f"unknown numpy bit generator {state.get('bit_generator')!r}")
            gen = np.random.Generator(bitgen())
        gen.bit_generator.state = state
        return gen

    def n_py_random(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        state = self.node(node.get("state"), None, path)
        gen = live if isinstance(live, random.Random) else random.Random()
        if not self.dry:
            gen.setstate(py_unstate(state))
        return gen

    def n_stateful(self, node: Mapping[str, Any], live: Any, path: tuple[Any, ...]) -> Any:
        load = getattr(live, "load_state_dict", None)
        if not callable(load):
            raise self.fail(
                path,
                f"checkpoint holds the state of a {node.get('class')}, "
                f"the state has {type(live).__qualname__} without load_state_dict()",
            )
        outer, self.strict = self.strict, isinstance(live, torch.nn.Module)
        mine = live.state_dict()
        try:  # into copies of its lists and dicts (a scheduler's are its own, some shared)
            sd = self.node(node.get("state"), mine if self.strict else _fresh(mine), path)
        finally:
            self.strict = outer
        why = misfit(node.get("class"), live, node.get("state"), mine)  # in the dry run
        if why is not None:
            raise self.fail(path, why)
        if not self.dry:
            load(sd)
        return live

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


def _fresh(x: Any) -> Any:
    """``x`` with its dicts and lists copied, the values in them not (tensors are restored into
    in place; the containers are load_state_dict()'s to take)."""
    if type(x) is dict:
        return {k: _fresh(v) for k, v in x.items()}
    if type(x) is list:
        return [_fresh(v) for v in x]
    return x


def arrays_of(tree: Any, out: dict[str, str] | None = None) -> dict[str, str]:
    """The arrays a stored tree references, in tree order: name -> the device a tensor was
    saved from ("" where not recorded)."""
    out = {} if out is None else out
    if isinstance(tree, dict):
        if tree.get("type") in ("tensor", "ndarray", "torch_generator") and isinstance(
                tree.get("name"), str):
            out.setdefault(tree["name"], str(tree.get("device", ""))
                           if tree["type"] == "tensor" else "")
        for v in tree.values():
            arrays_of(v, out)
    elif isinstance(tree, list):
        for v in tree:
            arrays_of(v, out)
    return out


def _spec(t: torch.Tensor) -> ArraySpec:
    return ArraySpec(dtypes.name_of(t.dtype), tuple(t.shape))


def apply(
    tree: Mapping[str, Any],
    state: Any,
    arrays: Mapping[str, torch.Tensor | ArraySpec],
    *,
    dry_run: bool = False,
    borrowed: bool = False,
    keep: Collection[str] = (),
    onto: Mapping[str, torch.device] | None = None,
) -> Any:
    """Restore ``tree`` into ``state`` in place, taking arrays by name from ``arrays``.

    With ``dry_run`` nothing changes and ``arrays`` may hold :class:`ArraySpec` s: every mismatch
    that the real pass would hit is raised as :class:`StateMismatchError` naming the key path.
    ``borrowed`` arrays live in a buffer that will be reused: values the state keeps (rather than
    copies into its own tensors) are copied out, but for those named in ``keep``. An array the
    state does not hold yet goes onto the device ``onto`` names for it, if any. Copies to CUDA
    tensors are queued without waiting; synchronize before reusing the arrays.
    """
    if not isinstance(state, dict):
        raise StateMismatchError(f"the state to restore into must be a dict, not {type(state)}")
    return _Applier(arrays, dry_run, borrowed, keep, onto).node(tree, state, ())
