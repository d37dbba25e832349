"""A shard's HDF5 metadata made once per layout, then written again with each save's values.

Laying a shard out through HDF5 costs milliseconds of CPU per save (a file, a dataset per tensor,
three attributes each), more than everything else a small checkpoint does. Between two saves of
the same state only a few values change: the root attributes ``step`` and ``tree`` and each
dataset's ``xxh3_64``. The file's format (:mod:`mpickpt.format.h5layout`) keeps attribute values
as they are, with no checksum over them, so:

1. :func:`build` lays the shard out twice in memory (:class:`~mpickpt.format.h5image.
   MetadataImage`), with two sets of random values of the same lengths as this save's;
2. it finds where each value of the first set lies (exactly once), writes the second set over
   the first image there and requires the result to be the second image, byte for byte;
3. a save of the same layout then copies the image and writes its values at those places
   (:meth:`Template.render`): the bytes HDF5 would have written.

The ``tree`` attribute is padded with spaces to a power of two bytes (JSON ignores them), so
that a tree that grows a little keeps the layout. A layout whose images do not pass step 2 is
never templated: HDF5 lays it out each time, as before.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from . import checksum, dtypes
from .h5image import MetadataImage
from .h5layout import Layout
from .records import TensorRecord

DIGITS = 16  # hex digits of one block's xxh3-64
MIN_TREE = 256  # bytes the tree attribute takes at least
KEEP = 2  # templates a writer keeps (the state of the last saves, and one other)

Runs = list[tuple[int, bytes]]


def tree_capacity(nbytes: int) -> int:
    """The bytes a tree of ``nbytes`` is padded to: a power of two, at least MIN_TREE."""
    return max(MIN_TREE, 1 << max(0, nbytes - 1).bit_length())


@dataclass(frozen=True)
class Template:
    """A layout's records (without checksums), its file's size and its metadata runs, and where
    in those runs each varying value goes: ``step``, ``tree``, then each record's checksums."""

    records: tuple[TensorRecord, ...]
    size: int
    runs: tuple[tuple[int, bytes], ...]
    places: tuple[tuple[int, int, int], ...]  # (run, position in it, length), by value

    def fresh_records(self) -> list[TensorRecord]:
        """Copies of the layout's records, to be given this save's checksums (their shapes are
        the template's lists: a record's shape is not changed)."""
        return [TensorRecord(r.name, r.dtype, r.shape, r.offset, r.nbytes)
                for r in self.records]

    def render(self, step: int, tree: str, sums: list[list[str]]) -> Runs:
        """The metadata runs of this layout with these values: ``sums`` by record."""
        values = _encode(step, tree, sums, self.places[1][2])
        out: list[bytes | bytearray] = [data for _, data in self.runs]
        copied: set[int] = set()
        for (run, at, n), v in zip(self.places, values, strict=True):
            if len(v) != n:
                raise ValueError(f"a value of {len(v)} bytes where the layout has {n}")
            if run not in copied:
                out[run], _ = bytearray(out[run]), copied.add(run)
            out[run][at:at + n] = v  # type: ignore[index]
        return [(off, bytes(d)) for (off, _), d in zip(self.runs, out, strict=True)]


def _encode(step: int, tree: str, sums: list[list[str]], capacity: int) -> list[bytes]:
    raw = tree.encode()
    return [struct.pack("<q", step), raw + b" " * (capacity - len(raw)),
            *(",".join(s).encode() for s in sums)]


def _random_values(sizes: list[int], capacity: int, block: int
                   ) -> tuple[int, str, list[list[str]]]:
    """A step, a tree and checksums of the lengths a save of this layout writes, at random."""
    def hexes(n: int) -> str:
        return os.urandom((n + 1) // 2).hex()[:n]

    step = int.from_bytes(os.urandom(8), "little") >> 1
    sums = [[hexes(DIGITS) for _ in range(checksum.block_count(n, block))] for n in sizes]
    return step, hexes(capacity), sums


def _image(tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str | int], step: int,
           tree: str, sums: list[list[str]], alignment: int, capacity: int
           ) -> tuple[list[TensorRecord], Runs, int]:
    """The layout's records, metadata runs and size, with these values."""
    image = MetadataImage()
    layout = Layout(image, alignment=alignment)
    try:
        padded = _encode(0, tree, [], capacity)[1].decode()
        layout.add(tensors, {k: step if k == "step" else padded if k == "tree" else v
                             for k, v in attrs.items()})
        records = [replace(r) for r in layout.records]
        for r, s in zip(layout.records, sums, strict=True):
            r.checksums = s
        layout.seal()
    except BaseException:
        layout.close()
        raise
    ranges = [(r.offset, r.nbytes) for r in records if r.nbytes]
    return records, list(image.extents(ranges)), image.size


def build(tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str | int], *,
          alignment: int, block: int) -> Template | None:
    """The template of this layout (``attrs`` holds ``step`` and ``tree``; the others, their
    values and the order of all are part of the layout), or None where HDF5's bytes are not the
    values in place."""
    capacity = tree_capacity(len(str(attrs["tree"]).encode()))
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    a, b = _random_values(sizes, capacity, block), _random_values(sizes, capacity, block)
    rec_a, runs_a, size_a = _image(tensors, attrs, a[0], a[1], a[2], alignment, capacity)
    rec_b, runs_b, size_b = _image(tensors, attrs, b[0], b[1], b[2], alignment, capacity)
    if [r.offset for r in rec_a] != [r.offset for r in rec_b] or size_a != size_b:
        return None
    places = _places(runs_a, _encode(*a, capacity))
    if places is None:
        return None
    t = Template(tuple(replace(r, checksums=[]) for r in rec_a), size_a, tuple(runs_a),
                 tuple(places))
    if [off for off, _ in runs_a] != [off for off, _ in runs_b] or t.render(*b) != runs_b:
        return None
    return t


def _places(runs: Runs, values: list[bytes]) -> list[tuple[int, int, int]] | None:
    """Where each value first lies in ``runs``: (run, position, length), or None where one is
    missing. Each search starts where the last value was found (HDF5 lays the values out in
    the order they were made, so it rarely goes round). A value HDF5 wrote twice is not
    caught here but by :func:`build`'s second image, in which the render would leave one copy
    of the other value behind."""
    out, run, at = [], 0, 0
    for v in values:
        hit = _find(runs, v, run, at)
        if hit is None or not v:
            return None
        run, at = hit
        out.append((run, at, len(v)))
        at += len(v)
    return out


def _find(runs: Runs, value: bytes, run: int, at: int) -> tuple[int, int] | None:
    """The first place of ``value`` from (``run``, ``at``) on, round to the start."""
    n = len(runs)
    for i in range(n + 1 if n else 0):
        k = (run + i) % n
        data = runs[k][1]
        lo = at if i == 0 else 0
        hi = len(data) if i < n else at + len(value) - 1  # (the last lap: the run's start)
        j = data.find(value, lo, hi)
        if j >= 0:
            return k, j
    return None


class Templates:
    """A writer's templates, by layout: the ``KEEP`` last used."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[object, ...], Template | None] = {}

    def get(self, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str | int], *,
            alignment: int, block: int) -> Template | None:
        """The template of this layout, built on first sight; None where there is none."""
        key = (alignment, block, tree_capacity(len(str(attrs["tree"]).encode())),
               tuple((k, None if k in ("step", "tree") else v) for k, v in attrs.items()),
               tuple((n, dtypes.name_of(t.dtype), tuple(t.shape)) for n, t in tensors.items()))
        if key in self._by_key:
            t = self._by_key.pop(key)
        else:
            t = build(tensors, attrs, alignment=alignment, block=block)
        self._by_key[key] = t  # the newest last
        while len(self._by_key) > KEEP:
            del self._by_key[next(iter(self._by_key))]
        return t
