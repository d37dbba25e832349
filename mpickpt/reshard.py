"""Plan and carry out one rank's reads of a checkpoint, whatever ranks and sharding wrote it.

Each array the stored tree references gets a *target*: for a sharded or replicated tensor in the
live state, the piece this rank now holds (its layout, :mod:`mpickpt.sharding`); otherwise the
stored per-rank tensor of rank ``r mod N`` as it is, or the whole tensor when only pieces of it
were stored. Every stored piece that overlaps a target is read over the byte range that holds the
overlap, widened to whole checksum blocks so each byte loaded is verified, and no other bytes;
nothing goes through another rank. A stored record that lands whole in one contiguous range of
its target (the same sharding, or rows of a coarser one) is read straight into place.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dtypes, sharding, state_tree
from .errors import ShardError, StateMismatchError
from .manifest import Manifest, RankEntry
from .pinned_pool import align
from .shard import TensorRecord, read_spans
from .state_tree import ArraySpec


@dataclass
class Target:
    """What this rank loads for one name: the box ``offsets``+``shape`` of ``global_shape``."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    # (source rank, record, overlap offsets (global), overlap shape)
    sources: list[tuple[int, TensorRecord, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def in_place(self, rec: TensorRecord, off: tuple[int, ...], shape: tuple[int, ...]
                 ) -> int | None:
        """Where (byte offset) a whole stored record lands in this target when it is one
        contiguous range of it (same sharding, or rows of a coarser one): read straight there.
        None otherwise."""
        if tuple(rec.shape) != shape:
            return None
        # contiguous in the target: full in every dimension after the last one where it is not,
        # and of size 1 in every dimension before that one
        partial = [d for d, (b, n) in enumerate(zip(shape, self.shape, strict=True)) if b != n]
        if partial and any(b != 1 for b in shape[:partial[-1]]):
            return None
        rel = tuple(o - t for o, t in zip(off, self.offsets, strict=True))
        first, _ = sharding.flat_span(self.shape, rel, shape)
        return first * dtypes.itemsize(self.dtype)


@dataclass
class Plan:
    """One rank's reads: the tree to apply, its targets, and the byte spans per shard file."""

    source_rank: int
    tree: dict[str, Any]
    targets: dict[str, Target]
    # (rank, record name) -> sorted disjoint [lo, hi) byte ranges of that record, block-aligned
    spans: dict[tuple[int, str], list[tuple[int, int]]]

    def specs(self) -> dict[str, ArraySpec]:
        return {n: ArraySpec(t.dtype, t.shape) for n, t in self.targets.items()}

    @property
    def bytes_to_read(self) -> int:
        return sum(hi - lo for ranges in self.spans.values() for lo, hi in ranges)


def _array_names(node: Any, out: list[str]) -> list[str]:
    """Names of the arrays a stored tree references, in tree order."""
    if isinstance(node, dict):
        if node.get("type") in ("tensor", "ndarray", "torch_generator") and isinstance(
                node.get("name"), str):
            out.append(node["name"])
        for v in node.values():
            _array_names(v, out)
    elif isinstance(node, list):
        for v in node:
            _array_names(v, out)
    return out


def _elements(rec: TensorRecord, off: tuple[int, ...], shape: tuple[int, ...]
              ) -> tuple[int, int]:
    """The element range [first, end) of stored record ``rec`` that holds the box at global
    ``off`` of ``shape``."""
    rel = tuple(o - s for o, s in zip(off, rec.offsets or [0] * len(off), strict=True))
    return sharding.flat_span(tuple(rec.shape), rel, shape)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def plan(manifest: Manifest, rank: int, world: int, state: dict[str, Any],
         replicated: tuple[str, ...], where: str) -> Plan:
    """Work out what this rank reads from ``manifest`` (at ``where``) to restore ``state``.

    Raises :class:`StateMismatchError` when a sharded tensor of the state does not match the
    stored one (dtype, global shape) and :class:`ShardError` when the stored pieces do not cover
    what this rank needs."""
    source = rank % manifest.world_size
    entry = manifest.ranks[source]
    own = {r.name: r for r in entry.tensors if r.global_shape is None}
    pieces: dict[str, list[tuple[int, TensorRecord]]] = {}
    for e in manifest.ranks:
        for r in e.tensors:
            if r.global_shape is not None:
                pieces.setdefault(r.name, []).append((e.rank, r))
    _, live, layouts = state_tree.flatten_layouts(state, replicated, world)
    targets: dict[str, Target] = {}
    for name in dict.fromkeys(_array_names(entry.tree, [])):
        targets[name] = _target(name, own, pieces, source, live, layouts, where)
    block = manifest.checksum_block
    wanted: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for t in targets.values():
        for src_rank, rec, off, shape in t.sources:
            item = dtypes.itemsize(rec.dtype)
            first, end = _elements(rec, off, shape)
            lo = first * item // block * block
            hi = min(-(-end * item // block) * block, rec.nbytes)
            wanted.setdefault((src_rank, rec.name), []).append((lo, hi))
    spans = {k: _merge(v) for k, v in wanted.items()}
    return Plan(source, entry.tree, targets, spans)


def _target(name: str, own: dict[str, TensorRecord],
            pieces: dict[str, list[tuple[int, TensorRecord]]], source: int,
            live: dict[str, torch.Tensor], layouts: dict[str, sharding.Layout],
            where: str) -> Target:
    layout = layouts.get(name)
    if layout is None:
        if name in own:  # a per-rank value, loaded as it was stored
            rec = own[name]
            shape = tuple(rec.shape)
            t = Target(name, rec.dtype, shape, (0,) * len(shape), shape)
            t.sources.append((source, rec, t.offsets, shape))
            return t
        if name not in pieces:
            raise ShardError(source, where, "the stored tree references an array that no rank's "
                             "records hold", tensor=name)
        rec = pieces[name][0][1]
        g = tuple(rec.global_shape or ())
        return _cover(Target(name, rec.dtype, g, (0,) * len(g), g), pieces[name], where)
    dtype = dtypes.name_of(live[name].dtype)
    t = Target(name, dtype, layout.global_shape, layout.offsets, layout.shape)
    stored = pieces.get(name)
    if stored is None and name in own and tuple(own[name].shape) == layout.global_shape:
        rec = own[name]  # stored whole by this rank's source rank: one piece at the origin
        stored = [(source, TensorRecord(**{**rec.__dict__, "global_shape": list(rec.shape),
                                           "offsets": [0] * len(rec.shape)}))]
    if stored is None:
        raise StateMismatchError(
            f"state[{name}]: the checkpoint holds no tensor {name!r} of global shape "
            f"{list(layout.global_shape)}")
    rec = stored[0][1]
    if rec.dtype != dtype or tuple(rec.global_shape or ()) != layout.global_shape:
        raise StateMismatchError(
            f"state[{name}]: checkpoint holds {rec.dtype}{list(rec.global_shape or [])}, the "
            f"state {dtype}{list(layout.global_shape)}")
    return _cover(t, stored, where)


def _cover(t: Target, stored: list[tuple[int, TensorRecord]], where: str) -> Target:
    """Attach the stored pieces overlapping ``t``; they must cover all of it."""
    got = 0
    for src_rank, rec in stored:
        if rec.dtype != t.dtype or tuple(rec.global_shape or ()) != t.global_shape:
            raise ShardError(src_rank, where, f"a piece of {rec.dtype}{rec.global_shape} among "
                             f"pieces of {t.dtype}{list(t.global_shape)}", tensor=t.name)
        box = sharding.overlap(t.offsets, t.shape, tuple(rec.offsets or ()), tuple(rec.shape))
        if box is not None:
            t.sources.append((src_rank, rec, *box))
            got += math.prod(box[1])
    clash = sharding.first_overlap([(off, shape) for _, _, off, shape in t.sources])
    if clash is not None:  # the stored pieces must not overlap, or their sizes prove nothing
        src_rank, rec, _, _ = t.sources[clash[1]]
        raise ShardError(src_rank, where, f"its piece {rec.shape} at {rec.offsets} overlaps "
                         f"another stored piece of {list(t.global_shape)}", tensor=t.name)
    if got != math.prod(t.shape):
        raise ShardError(t.sources[0][0] if t.sources else 0, where,
                         f"the stored pieces hold {got} of the {math.prod(t.shape)} elements "
                         f"this rank needs (at {list(t.offsets)} of {list(t.global_shape)})",
                         tensor=t.name)
    return t


def execute(p: Plan, manifest: Manifest, directory: str, *, threads: int,
            buffer: Callable[[int], torch.Tensor],
            on_block: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """Read and verify the planned spans; assemble and return every target by name. The records
    of the shards read must have passed :func:`mpickpt.shard.check_records` (restore checks
    them before it plans, and before anything is allocated)."""
    offsets, pos = {}, 0
    for name, t in p.targets.items():
        offsets[name] = pos
        pos = align(pos + t.nbytes)
    buf = buffer(pos)
    out = {n: buf[offsets[n]: offsets[n] + t.nbytes].view(dtypes.torch_dtype(t.dtype))
           .view(t.shape) for n, t in p.targets.items()}
    direct: dict[tuple[int, str], int] = {}  # stored record -> byte offset in its target
    for t in p.targets.values():
        for src_rank, rec, off, shape in t.sources:
            at = t.in_place(rec, off, shape)
            if at is not None:
                direct[(src_rank, rec.name)] = at
    by_rank: dict[int, list[tuple[TensorRecord, int, int, torch.Tensor]]] = {}
    staged: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
    for n, t in p.targets.items():
        for src_rank, rec, _, _ in t.sources:
            key = (src_rank, rec.name)
            if key in staged:
                continue
            dests: list[tuple[int, torch.Tensor]] = []
            for lo, hi in p.spans[key]:
                if key in direct:
                    at = direct[key]
                    dest = out[n].reshape(-1).view(torch.uint8)[at + lo: at + hi]
                else:
                    dest = torch.empty(hi - lo, dtype=torch.uint8)
                dests.append((lo, dest))
                by_rank.setdefault(src_rank, []).append((rec, lo, hi, dest))
            staged[key] = dests
    for src_rank, spans in by_rank.items():
        entry: RankEntry = manifest.ranks[src_rank]
        read_spans(src_rank, os.path.join(directory, entry.file), entry.bytes, spans,
                   block=manifest.checksum_block, threads=threads, on_block=on_block)
    for n, t in p.targets.items():
        for src_rank, rec, off, shape in t.sources:
            if (src_rank, rec.name) not in direct:
                _copy_box(out[n], t, rec, staged[(src_rank, rec.name)], off, shape)
    return out


def _copy_box(dest: torch.Tensor, t: Target, rec: TensorRecord,
              spans: list[tuple[int, torch.Tensor]], off: tuple[int, ...],
              shape: tuple[int, ...]) -> None:
    """Copy the overlap box (global ``off``, ``shape``) from the staged spans of ``rec``."""
    if math.prod(shape) == 0:
        return
    item = dtypes.itemsize(rec.dtype)
    first, _ = _elements(rec, off, shape)
    lo, span = next((lo, s) for lo, s in reversed(spans) if lo <= first * item)
    flat = span.view(dtypes.torch_dtype(rec.dtype))[first - lo // item:]
    strides = tuple(math.prod(rec.shape[d + 1:]) for d in range(len(rec.shape)))
    src = flat.as_strided(shape, strides, flat.storage_offset())
    box = tuple(slice(o - to, o - to + n) for o, to, n in zip(off, t.offsets, shape, strict=True))
    dest[box].copy_(src)

