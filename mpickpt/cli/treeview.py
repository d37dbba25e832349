"""A rank's state tree (:mod:`mpickpt.format.state_tree`'s JSON) as indented lines for a person.

One line per key: ``key: what``, where ``what`` is a scalar's value, a tensor's dtype and shape
(from the manifest's records; a piece of a sharded tensor says where it lies in the whole), or a
container's kind and size, its items indented below. An object with ``state_dict()`` shows its
class and the items of its state dict. A long list of plain values is shown on one line, cut
short. Pure JSON in, strings out: nothing is imported or loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..format.records import TensorRecord

INDENT = "  "
MAX_INLINE = 8  # a list or tuple of at most this many plain values is written on one line
MAX_TEXT = 60  # characters of a string (or of a long list of values) shown


def _cut(text: str, n: int = MAX_TEXT) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _scalar(node: Mapping[str, Any]) -> str | None:
    """The value of a plain leaf as Python would write it, or None for anything else."""
    kind, v = node.get("type"), node.get("value")
    if kind == "none":
        return "None"
    if kind == "bool":
        return "True" if v else "False"
    if kind in ("int", "float"):
        return str(v)
    if kind == "str":
        return _cut(repr(v))
    if kind == "bytes":
        return f"bytes ({len(str(v)) // 2} B)"
    if kind == "torch_dtype":
        return f"torch.{v}"
    return None


def _array(node: Mapping[str, Any], records: Mapping[str, TensorRecord]) -> str:
    r = records.get(str(node.get("name")))
    kind = "scalar ndarray" if node.get("scalar") else str(node["type"])
    if r is None:
        return f"{kind} {node.get('name')} (no record in the manifest)"
    text = f"{kind} {r.dtype} {r.shape}"
    if r.global_shape is not None:
        text += f" (piece at {r.offsets} of {r.global_shape})"
    device = node.get("device")
    if device and device != "cpu":
        text += f" on {device}"
    return text


def _items(node: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The (label, child) pairs of a container node."""
    if node.get("type") == "dict":
        return [(str(k), v) for k, v in node.get("items", [])]
    return [(f"[{i}]", v) for i, v in enumerate(node.get("items", []))]


def _inline(node: Mapping[str, Any]) -> str | None:
    """A list or tuple of plain values on one line, or None when it holds containers."""
    items = node.get("items", [])
    values = [v for x in items if isinstance(x, Mapping) and (v := _scalar(x)) is not None]
    if len(values) != len(items):
        return None
    one = "," if node["type"] == "tuple" and len(values) == 1 else ""
    text = ("({}{})" if node["type"] == "tuple" else "[{}{}]").format(", ".join(values), one)
    if len(values) <= MAX_INLINE and len(text) <= MAX_TEXT:
        return text
    return f"{node['type']} of {len(values)} values: {_cut(text)}"


def lines(tree: Mapping[str, Any], records: list[TensorRecord]) -> list[str]:
    """The tree as indented ``key: what`` lines (the root's items at the first level)."""
    by_name = {r.name: r for r in records}
    out: list[str] = []

    def walk(label: str, node: Any, depth: int) -> None:
        pad = INDENT * depth
        if not isinstance(node, Mapping) or not isinstance(node.get("type"), str):
            out.append(f"{pad}{label}: ? {_cut(repr(node))}")
            return
        kind = node["type"]
        if (value := _scalar(node)) is not None:
            out.append(f"{pad}{label}: {value}")
        elif kind in ("tensor", "ndarray"):
            out.append(f"{pad}{label}: {_array(node, by_name)}")
        elif kind == "torch_generator":
            out.append(f"{pad}{label}: torch.Generator ({node.get('device', 'cpu')})")
        elif kind in ("np_generator", "py_random"):
            name = "numpy.random.Generator" if kind == "np_generator" else "random.Random"
            out.append(f"{pad}{label}: {name} (its state)")
        elif kind == "stateful":
            out.append(f"{pad}{label}: {node.get('class')} (state_dict)")
            state = node.get("state")
            if isinstance(state, Mapping) and state.get("type") == "dict":
                for k, child in _items(state):
                    walk(k, child, depth + 1)
            else:
                walk("state", state, depth + 1)
        elif kind in ("dict", "list", "tuple"):
            inline = None if kind == "dict" else _inline(node)
            if inline is not None:
                out.append(f"{pad}{label}: {inline}")
                return
            items = _items(node)
            out.append(f"{pad}{label}: {kind}, {len(items)} item{'' if len(items) == 1 else 's'}")
            for k, child in items:
                walk(k, child, depth + 1)
        else:
            out.append(f"{pad}{label}: {kind}")

    if tree.get("type") == "dict":
        for k, child in _items(tree):
            walk(k, child, 0)
    else:
        walk("<state>", tree, 0)
    return out
