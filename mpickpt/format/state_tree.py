"""Flatten a user's state into named tensors plus a JSON tree; apply a stored tree back in place.

The tree is plain JSON (no pickle): each node is ``{"type": ..., ...}``. Containers keep their key
types and order (``dict`` items are ``[key, node]`` pairs, so integer keys of an optimizer's state
stay integers). Leaves are either values written in the node (int, float, bool, str, None, bytes as
hex, torch dtypes) or references by name to an array in the shard (``tensor``, ``ndarray``,
``torch_generator``). Objects with ``state_dict()``/``load_state_dict()`` become ``stateful`` nodes
holding the tree of their state dict; only their class name is recorded, never imported.

Applying is two-pass: :func:`apply` with ``dry_run=True`` checks the whole tree against the live
state and changes nothing, so a restore that would not fit fails before any tensor is touched; the
real pass then copies into existing tensors in place and calls ``load_state_dict``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import sharding
from ..errors import StateMismatchError, StateTreeError
from ..sharding import Piece, Placement
from ..stateful import misfit, py_state, py_unstate
from . import dtypes

MAX_DEPTH = 64  # levels of nesting in a state (its JSON tree takes about 3 per level: the
# manifest refuses trees deeper than 256)


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype name of a stored array, known before its bytes are read."""

    dtype: str
    shape: tuple[int, ...]


def _escape(key: Any) -> str:
    s = key if type(key) is str else str(key)
    if "%" in s or "/" in s:
        s = s.replace("%", "%25").replace("/", "%2F")
    if s in ("", ".", ".."):  # not valid as an HDF5 path component
        return "%" + s.replace(".", "%2E")
    return s


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(_escape(k) for k in path) or "<root>"


# ------------------------------------------------------------------------------------- flatten


class _Flattener:
    def __init__(self, replicated: tuple[str, ...] = (), world: int = 1) -> None:
        self.arrays: dict[str, torch.Tensor] = {}
        self.placements: dict[str, Placement] = {}
        self.replicated, self._under = frozenset(replicated), tuple(f"{p}/" for p in replicated)
        self.unmatched = set(replicated)  # replicated key paths not met in the state yet
        self.world = world

    def is_replicated(self, where: str) -> bool:
        """Whether the key path ``where`` (:func:`_path_str`) is under a replicated one."""
        return where in self.replicated or where.startswith(self._under)

    def name(self, base: str) -> str:
        name, n = base, 1
        while name in self.arrays:
            name, n = f"{base}~{n}", n + 1
        return name

    def tensor(self, t: torch.Tensor, where: str) -> str:
        if t.layout != torch.strided or t.is_meta or t.is_quantized:
            raise StateTreeError(
                f"state[{where}]: tensor with layout {t.layout} on {t.device} cannot be "
                "saved; only dense (strided) tensors with data are supported"
            )
        try:
            dtypes.name_of(t.dtype)
        except ValueError as e:
            raise StateTreeError(f"state[{where}]: {e}") from None
        name = self.name(where)  # (a state_dict()'s tensors are detached already)
        self.arrays[name] = t if type(t) is torch.Tensor and not t.requires_grad else t.detach()
        return name

    def global_tensor(self, x: Any, path: tuple[Any, ...], where: str) -> dict[str, Any]:
        """A tensor node; for a sharded or replicated one (DTensor, :class:`Piece`, declared
        replicated) its placement is recorded and the node marked ``sharded``."""
        try:
            placement = sharding.placement_of(x, where, self.is_replicated(where), self.world)
        except ValueError as e:
            raise StateTreeError(f"state[{where}]: {e}") from None
        local = sharding.local_tensor(x)
        node = {"type": "tensor", "name": self.tensor(local, where),
                "device": str(local.device)}
        if placement is not None:
            self.placements[node["name"]] = placement
            node["sharded"] = True
        return node

    def node(self, x: Any, path: tuple[Any, ...], where: str = "<root>") -> dict[str, Any]:
        """``where``: ``_path_str(path)``, built a key at a time by the caller."""
        if self.unmatched:
            self.unmatched.discard(where)
        if len(path) > MAX_DEPTH:
            raise StateTreeError(f"state[{_path_str(path[:8])}/...]: nested more than "
                                 f"{MAX_DEPTH} levels deep; a restore would refuse its tree")
        kind = type(x)  # the most common first, by their exact type (a state_dict(): OrderedDict)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return self.global_tensor(x, path, where)
        if kind is dict or kind is OrderedDict or kind is list or kind is tuple:
            return self.container(x, path, where)
        if isinstance(x, (torch.Tensor, Piece)):
            return self.global_tensor(x, path, where)
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
        if isinstance(x, np.generic):
            return self.ndarray(np.asarray(x), where) | {"scalar": True}
        if isinstance(x, torch.Generator):
            return {
                "type": "torch_generator",
                "name": self.tensor(x.get_state(), where),
                "device": str(x.device),
            }
        if isinstance(x, np.random.Generator):
            return {"type": "np_generator",
                    "state": self.node(x.bit_generator.state, path, where)}
        if isinstance(x, random.Random):
            return {"type": "py_random", "state": self.node(py_state(x.getstate()), path, where)}
        if isinstance(x, Mapping) or kind in (list, tuple):  # (not a named tuple)
            return self.container(x, path, where)
        if callable(getattr(x, "state_dict", None)) and callable(
                getattr(x, "load_state_dict", None)):
            return {"type": "stateful", "class": f"{kind.__module__}.{kind.__qualname__}",
                    "state": self.node(x.state_dict(), path, where)}
        raise StateTreeError(
            f"state[{where}]: cannot save an object of type {kind.__qualname__}; "
            "use tensors, numpy arrays, numbers, strings, None, lists, tuples, dicts, or an "
            "object with state_dict()/load_state_dict()")

    def container(self, x: Any, path: tuple[Any, ...], where: str) -> dict[str, Any]:
        """A mapping, a list or a tuple."""
        at = f"{where}/" if path else ""  # a child's where: this and its key
        if type(x) is dict or type(x) is OrderedDict or isinstance(x, Mapping):
            return {"type": "dict", "items": [
                [self.key(k, path), self.node(v, (*path, k), f"{at}{_escape(k)}")]
                for k, v in x.items()]}
        return {"type": type(x).__name__,
                "items": [self.node(v, (*path, i), f"{at}{i}") for i, v in enumerate(x)]}

    def key(self, k: Any, path: tuple[Any, ...]) -> Any:
        if type(k) is str or isinstance(k, (str, int, float, bool)) or k is None:
            return k
        raise StateTreeError(
            f"state[{_path_str(path)}]: dict key {k!r} of type {type(k).__qualname__} cannot be "
            "saved; keys must be str, int, float, bool or None"
        )

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
                   strict: bool = True
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Placement]]:
    """:func:`flatten`, plus the placement of every sharded or replicated tensor by name.
    ``replicated``: key paths ("model", "optim/state") whose plain tensors every one of the
    ``world`` ranks holds alike; ``strict``: one that matches no tensor is an error (a typo, at
    a save; a restore may build those tensors from the checkpoint)."""
    f = _Flattener(replicated, world)
    tree = f.node(state, ())
    if f.unmatched and strict:
        keys = ", ".join(repr(k) for k in state) if isinstance(state, Mapping) else "none"
        raise StateTreeError(
            f"Checkpointer(replicated=...): {', '.join(repr(p) for p in sorted(f.unmatched))} "
            f"{'match' if len(f.unmatched) > 1 else 'matches'} nothing in the state "
            f"(a typo?); its top-level keys are {keys}. Key paths are joined with '/', "
            "e.g. 'model' or 'optim/state'")
    return tree, f.arrays, f.placements


# --------------------------------------------------------------------------------------- apply


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
        try:
            sd = self.node(node.get("state"), mine := live.state_dict(), path)
        finally:
            self.strict = outer
        why = misfit(node.get("class"), live, node.get("state"), mine)  # in the dry run
        if why is not None:
            raise self.fail(path, why)
        if not self.dry:
            load(sd)
        return live


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
