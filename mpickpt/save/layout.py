"""Where each tensor of a snapshot goes in its buffer, and the views of a reused buffer for a
state's layout, made once per buffer and layout.

Views are made per tensor (a slice, a dtype, a shape: about 8 µs each); for a state of 600
tensors (the Hugging Face Trainer's GPT-2 with its AdamW state) that was 5 ms of the training
thread at every save, twice with a GPU's staging buffer. A reused buffer with the layout it had
at the last save gets the views it had then.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch

from ..format.blocks import ALIGN, align
from ..format.dtypes import name_of

V = TypeVar("V")


# a tensor of fewer bytes than a page starts on a cache line instead of a page of its own: the
# 8,000 tensors of a thousand small layers and their Adam state took 32.8 MB of buffer for
# 3.4 MB of bytes, and a page each to copy into (its offset in a shard is HDF5's, never aligned
# for O_DIRECT, so nothing is lost)
SMALL_ALIGN = 64


class Placed(NamedTuple):
    """Where each tensor of a snapshot goes in its buffer (:func:`place`)."""

    by_device: dict[torch.device, list[str]]  # names by device
    order: list[torch.device]  # the devices in the buffer's order (CPU last)
    offsets: dict[str, int]
    ranges: dict[torch.device, tuple[int, int]]  # each device's range, page-aligned
    total: int  # bytes
    key: tuple[Any, ...]  # what the views of a buffer with this layout depend on (Views.get)


def place(tensors: Mapping[str, torch.Tensor]) -> Placed:
    """Where each tensor goes in a snapshot's buffer: each device's tensors form one contiguous
    range, CPU last; a tensor of a page or more starts on a page, a smaller one on a cache
    line. One pass over the tensors: this is paid on the training thread at every save.

    The key is of strings and integers alone, which Python's collector stops tracking (a
    ``torch.dtype`` or a ``torch.Size`` in it kept two objects a tensor tracked for as long as
    the key is kept)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        dev = t.device
        group = by_device.get(dev)
        if group is None:
            group = by_device[dev] = []
        group.append(name)
    order = sorted(by_device, key=lambda d: (d.type == "cpu", str(d)))
    offsets: dict[str, int] = {}
    ranges: dict[torch.device, tuple[int, int]] = {}
    key: list[tuple[str, int, str, tuple[int, ...]]] = []
    pos = 0
    for dev in order:
        start = pos
        for name in by_device[dev]:
            t = tensors[name]
            n = t.nbytes
            a = ALIGN if n >= ALIGN else SMALL_ALIGN
            pos = -(-pos // a) * a
            offsets[name] = pos
            key.append((name, pos, name_of(t.dtype), tuple(t.shape)))
            pos += n
        pos = align(pos)
        ranges[dev] = (start, pos)
    return Placed(by_device, order, offsets, ranges, pos, tuple(key))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def views(buf: torch.Tensor, offsets: Mapping[str, int],
          tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: view(buf, offsets[name], t) for name, t in tensors.items()}


def view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape over ``buf[offset:]``."""
    return buf[offset : offset + nbytes(like)].view(like.dtype).view(like.shape)


class Views:
    """Views of buffers, kept per buffer (and part of it) for its last layout until the buffer
    is let go: :meth:`forget` (the views hold the buffer's memory). No lock: two threads asking
    at once at worst make the views twice, and an entry is replaced whole."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, Hashable], tuple[torch.Tensor, Any, Any]] = {}

    def get(self, buf: torch.Tensor, part: Hashable, layout: Any, make: Callable[[], V]) -> V:
        """The views of ``buf``'s ``part`` for ``layout`` (a :func:`key`): ``make()``'s, made
        again only when the layout is not the one ``buf``'s part had last. They are shared:
        read them, never change them."""
        slot = (id(buf), part)
        hit = self._kept.get(slot)
        if hit is not None and hit[0] is buf and hit[1] == layout:
            return hit[2]  # type: ignore[no-any-return]
        made = make()
        self._kept[slot] = (buf, layout, made)
        return made

    def forget(self, buf: torch.Tensor) -> None:
        """``buf`` is let go: its views go too."""
        for slot in [k for k, v in list(self._kept.items()) if v[0] is buf]:
            self._kept.pop(slot, None)
