"""Where each tensor of a snapshot goes in its buffer, and the views of a reused buffer for a
state's layout, made once per buffer and layout.

Views are made per tensor (a slice, a dtype, a shape: about 8 µs each); for a state of 600
tensors (the Hugging Face Trainer's GPT-2 with its AdamW state) that was 5 ms of the training
thread at every save, twice with a GPU's staging buffer. A reused buffer with the layout it had
at the last save gets the views it had then.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch

from ..format.blocks import align
from ..format.dtypes import name_of

V = TypeVar("V")


def place(tensors: Mapping[str, torch.Tensor]) -> tuple[
        dict[torch.device, list[str]], list[torch.device], dict[str, int],
        dict[torch.device, tuple[int, int]], int]:
    """Where each tensor goes in a snapshot's buffer: each device's tensors form one contiguous
    range, CPU last. (names by device, devices in order, offsets, ranges, total bytes)"""
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append(name)
    order = sorted(by_device, key=lambda d: (d.type == "cpu", str(d)))
    offsets: dict[str, int] = {}
    ranges: dict[torch.device, tuple[int, int]] = {}
    pos = 0
    for dev in order:
        start = pos
        for name in by_device[dev]:
            offsets[name] = pos
            pos = align(pos + nbytes(tensors[name]))
        ranges[dev] = (start, pos)
    return by_device, order, offsets, ranges, pos


def key(tensors: Mapping[str, torch.Tensor], offsets: Mapping[str, int]) -> tuple[Any, ...]:
    """What the views of a buffer for ``tensors`` at ``offsets`` depend on: of strings and
    integers alone, which Python's collector stops tracking (a ``torch.dtype`` or a
    ``torch.Size`` in it kept two objects a tensor tracked for as long as the key is kept)."""
    return tuple((n, offsets[n], name_of(t.dtype), tuple(t.shape)) for n, t in tensors.items())


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
