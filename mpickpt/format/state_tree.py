"""Flatten a user's state into named tensors plus a JSON tree (:mod:`.state_apply` applies a
stored tree back in place).

The tree is plain JSON (no pickle): each node is ``{"type": ..., ...}``. Containers keep their key
types and order (``dict`` items are ``[key, node]`` pairs, so integer keys of an optimizer's state
stay integers). Leaves are either values written in the node (int, float, bool, str, None, bytes as
hex, torch dtypes) or references by name to an array in the shard (``tensor``, ``ndarray``,
``torch_generator``). Objects with ``state_dict()``/``load_state_dict()`` become ``stateful`` nodes
holding the tree of their state dict; only their class name is recorded, never imported.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import sharding
from ..errors import StateTreeError
from ..sharding import Piece, Placement
from ..stateful import py_state
from . import dtypes

_STRIDED = torch.strided
_DTYPES = dtypes.supported()
MAX_DEPTH = 64  # levels of nesting in a state (its JSON tree takes about 3 per level: the
# manifest refuses trees deeper than 256)


def _escape(key: Any) -> str:
    s = key if type(key) is str else str(key)
    if "%" in s or "/" in s:
        s = s.replace("%", "%25").replace("/", "%2F")
    if s in ("", ".", ".."):  # not valid as an HDF5 path component
        return "%" + s.replace(".", "%2E")
    return s


def _utf8(s: str) -> bool:
    try:
        s.encode()
        return True
    except UnicodeEncodeError:  # a lone surrogate
        return False


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(_escape(k) for k in path) or "<root>"


# ------------------------------------------------------------------------------------- flatten


class _Flattener:
    def __init__(self, replicated: tuple[str, ...] = (), world: int = 1,
                 owners: list[Any] | None = None) -> None:
        self.arrays: dict[str, torch.Tensor] = {}
        self.owners = owners  # where the optimizers and modules met go, if anywhere
        self.placements: dict[str, Placement] = {}
        self.replicated, self._under = frozenset(replicated), tuple(f"{p}/" for p in replicated)
        self.unmatched = set(replicated)  # replicated key paths not met in the state yet
        self.world = world
        self._devices: dict[torch.device, str] = {}  # str() of a device, once per device
        self._whole: dict[torch.Size, Placement] = {}  # a replicated shape's, once per shape

    def is_replicated(self, where: str) -> bool:
        """Whether the key path ``where`` (:func:`_path_str`) is under a replicated one."""
        return where in self.replicated or where.startswith(self._under)

    def name(self, base: str) -> str:
        name, n = base, 1
        while name in self.arrays:
            name, n = f"{base}~{n}", n + 1
        return name

    def tensor(self, t: torch.Tensor, where: str) -> str:
        if t.layout != torch.strided or t.is_meta or t.is_quantized or t.is_nested:
            raise StateTreeError(
                f"state[{where}]: {'nested ' if t.is_nested else ''}tensor with layout "
                f"{t.layout} on {t.device} cannot be saved; only dense (strided) tensors with "
                "data are supported")
        try:
            dtypes.name_of(t.dtype)
        except ValueError as e:
            raise StateTreeError(f"state[{where}]: {e}") from None
        name = self.name(where)
        self.arrays[name] = t.detach()  # (its own shape: the user's may change after save())
        return name

    def plain(self, t: torch.Tensor, where: str) -> dict[str, Any]:
        """:meth:`global_tensor` for a plain tensor or parameter (the most common leaf, at
        every save: a few function calls less a tensor); anything unusual goes the long way."""
        if (t.dtype not in _DTYPES or t.layout is not _STRIDED or t.is_nested or t.is_quantized
                or t.is_meta):
            return self.global_tensor(t, where)  # (it raises what it cannot save)
        name = where if where not in self.arrays else self.name(where)
        self.arrays[name] = t.detach()  # (its own shape: the user's may change after save())
        dev = t.device
        device = self._devices.get(dev)
        if device is None:
            device = self._devices[dev] = str(dev)
        if where in self.replicated or where.startswith(self._under):
            shape = t.shape
            placement = self._whole.get(shape)
            if placement is None:
                placement = self._whole[shape] = sharding.whole(tuple(shape), self.world)
            self.placements[name] = placement
            return {"type": "tensor", "name": name, "device": device, "sharded": True}
        return {"type": "tensor", "name": name, "device": device}

    def global_tensor(self, x: Any, where: str) -> dict[str, Any]:
        """A tensor node; for a sharded or replicated one (DTensor, :class:`Piece`, declared
        replicated) its placement is recorded and the node marked ``sharded``."""
        try:
            placement = sharding.placement_of(x, where, self.is_replicated(where), self.world)
        except ValueError as e:
            raise StateTreeError(f"state[{where}]: {e}") from None
        local = sharding.local_tensor(x)
        dev = local.device
        device = self._devices.get(dev)
        if device is None:
            device = self._devices[dev] = str(dev)
        node = {"type": "tensor", "name": self.tensor(local, where), "device": device}
        if placement is not None:
            self.placements[node["name"]] = placement
            node["sharded"] = True
        return node

    def node(self, x: Any, depth: int, where: str = "<root>") -> dict[str, Any]:
        """``where``: the key path (:func:`_path_str`), built a key at a time by the caller;
        ``depth``: its number of keys."""
        if self.unmatched:
            self.unmatched.discard(where)
        if depth > MAX_DEPTH:
            raise StateTreeError(f"state[{'/'.join(where.split('/')[:8])}/...]: nested more "
                                 f"than {MAX_DEPTH} levels deep; a restore would refuse its tree")
        kind = type(x)  # the most common first, by their exact type (a state_dict(): OrderedDict)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return self.plain(x, where)
        if kind is dict or kind is OrderedDict or kind is list or kind is tuple:
            return self.container(x, depth, where)
        if kind is float:  # (an optimizer's hyperparameters: exact types, no conversion)
            return {"type": "float", "value": x if math.isfinite(x) else repr(x)}
        if kind is int:
            return {"type": "int", "value": x}
        if kind is bool:
            return {"type": "bool", "value": x}
        if kind is str:
            return {"type": "str", "value": x}
        if isinstance(x, (torch.Tensor, Piece)):
            return self.global_tensor(x, where)
        if isinstance(x, np.generic) and not isinstance(x, (str, bytes)):  # (np.float64: a float)
            return self.ndarray(np.asarray(x), where) | {"scalar": True}
        if x is None:
            return {"type": "none"}
        if isinstance(x, bool):  # bool before int: bool is a subclass of int
            return {"type": "bool", "value": x}
        if isinstance(x, int):
            return {"type": "int", "value": x if kind is int else int(x)}
        if isinstance(x, float):
            v = x if kind is float else float(x)
            return {"type": "float", "value": v if math.isfinite(v) else repr(v)}
        if isinstance(x, str):
            return {"type": "str", "value": x if kind is str else str(x)}
        if isinstance(x, bytes):
            return {"type": "bytes", "value": x.hex()}
        if isinstance(x, torch.dtype):
            try:
                return {"type": "torch_dtype", "value": dtypes.name_of(x)}
            except ValueError as e:
                raise StateTreeError(f"state[{where}]: {e}") from None
        if isinstance(x, np.ndarray):
            return self.ndarray(x, where)
        if isinstance(x, torch.Generator):
            return {
                "type": "torch_generator",
                "name": self.tensor(x.get_state(), where),
                "device": str(x.device),
            }
        if isinstance(x, np.random.Generator):
            return {"type": "np_generator",
                    "state": self.node(x.bit_generator.state, depth, where)}
        if isinstance(x, random.Random):
            return {"type": "py_random",
                    "state": self.node(py_state(x.getstate()), depth, where)}
        if isinstance(x, Mapping) or kind in (list, tuple):  # (not a named tuple)
            return self.container(x, depth, where)
        if callable(getattr(x, "state_dict", None)) and callable(
                getattr(x, "load_state_dict", None)):
            if self.owners is not None and isinstance(x, (torch.optim.Optimizer,
                                                          torch.nn.Module)):
                self.owners.append(x)
            return {"type": "stateful", "class": f"{kind.__module__}.{kind.__qualname__}",
                    "state": self.node(x.state_dict(), depth, where)}
        raise StateTreeError(
            f"state[{where}]: cannot save an object of type {kind.__qualname__}; "
            "use tensors, numpy arrays, numbers, strings, None, lists, tuples, dicts, or an "
            "object with state_dict()/load_state_dict()")

    def container(self, x: Any, depth: int, where: str) -> dict[str, Any]:
        """A mapping, a list or a tuple."""
        at = f"{where}/" if depth else ""  # a child's where: this and its key
        node, down = self.node, depth + 1
        if type(x) is dict or type(x) is OrderedDict or isinstance(x, Mapping):
            key = self.key
            return {"type": "dict", "items": [
                [key(k, where), node(v, down, f"{at}{_escape(k)}")] for k, v in x.items()]}
        return {"type": type(x).__name__,
                "items": [node(v, down, f"{at}{i}") for i, v in enumerate(x)]}

    def key(self, k: Any, where: str) -> Any:
        """A dict key of the container at ``where``, as the tree keeps it."""
        if (type(k) is str and k.isascii()) or isinstance(k, int) or k is None or (
                isinstance(k, float) and math.isfinite(k)) or (isinstance(k, str) and _utf8(k)):
            return k
        raise StateTreeError(
            f"state[{where}]: dict key {k!r} of type {type(k).__qualname__} cannot be "
            "saved; keys must be str (of valid UTF-8), int, finite float, bool or None")

    def ndarray(self, a: np.ndarray, where: str) -> dict[str, Any]:
        if not a.dtype.isnative and a.dtype.itemsize > 1:
            a = a.astype(a.dtype.newbyteorder("="))
        try:
            t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))
        except TypeError:
            raise StateTreeError(
                f"state[{where}]: numpy array of dtype {a.dtype} cannot be saved"
            ) from None
        return {"type": "ndarray", "name": self.tensor(t, where)}


def flatten(state: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able tree and a table of tensors referenced from it by name.

    The tensors are the user's own (detached, not copied; a DTensor's local piece); callers
    snapshot them as they need.
    """
    tree, arrays, _ = flatten_placed(state)
    return tree, arrays


def flatten_placed(state: Any, replicated: tuple[str, ...] = (), world: int = 1, *,
                   strict: bool = True, owners: list[Any] | None = None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Placement]]:
    """:func:`flatten`, plus the placement of every sharded or replicated tensor by name.
    ``replicated``: key paths ("model", "optim/state") whose plain tensors every one of the
    ``world`` ranks holds alike; ``strict``: one that matches no tensor is an error (a typo, at
    a save; a restore may build those tensors from the checkpoint); ``owners``: a list the
    optimizers and modules of the state are appended to, as they are met (what a snapshot
    guards: :meth:`mpickpt.save.snapshot.Snapshotter.guard`)."""
    f = _Flattener(replicated, world, owners)
    tree = f.node(state, 0)
    if f.unmatched and strict:
        keys = ", ".join(repr(k) for k in state) if isinstance(state, Mapping) else "none"
        raise StateTreeError(
            f"Checkpointer(replicated=...): {', '.join(repr(p) for p in sorted(f.unmatched))} "
            f"{'match' if len(f.unmatched) > 1 else 'matches'} nothing in the state "
            f"(a typo?); its top-level keys are {keys}. Key paths are joined with '/', "
            "e.g. 'model' or 'optim/state'")
    return tree, f.arrays, f.placements
