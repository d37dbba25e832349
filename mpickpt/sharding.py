"""Where each rank's piece of a tensor lies in the whole tensor, and who writes replicated pieces.

A tensor in the state is one of:

* **per-rank** (the default): this rank's own value, restored to the rank of the same number
  (rank ``r mod N`` when a checkpoint of N ranks is restored on another number of ranks);
* **sharded**: this rank holds the box ``offsets .. offsets + shape`` of a tensor of
  ``global_shape`` - taken from a ``DTensor``'s placements (FSDP2, tensor parallel), or declared
  with :class:`Piece`;
* **replicated**: every rank (or, for a DTensor with ``Replicate`` mesh dimensions, every rank of
  its replica group) holds the same piece - declared with ``Piece(t, replicated=True)``, with the
  Checkpointer's ``replicated`` key paths (DDP), or taken from a DTensor.

Identical pieces held by several ranks are written once, spread over their holders by size, or over
as few of them as gives each writer ``Files(min_write_share=)`` bytes (:func:`writers`). A restore
assembles each rank's new piece from the stored pieces that overlap it, whatever the number of ranks
or the sharding was (:mod:`mpickpt.restore.reshard`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import StateTreeError


@dataclass(frozen=True)
class Placement:
    """A rank's piece of a global tensor. ``holders``: the ranks holding the same piece (those
    that could write it), in increasing order, or None when the piece is this rank's alone; a
    ``range`` when they are evenly spaced (every rank: DDP), so that nothing per tensor grows
    with the number of ranks."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    holders: Sequence[int] | None = None


class Piece:
    """Declare that ``tensor`` is the box at ``offsets`` of a tensor of ``global_shape`` (or, with
    ``replicated=True``, that every rank holds the same ``tensor``). Put it in the state where the
    tensor would be; restore copies the new piece into ``tensor`` in place."""

    def __init__(self, tensor: torch.Tensor, global_shape: Sequence[int] | None = None,
                 offsets: Sequence[int] | None = None, *, replicated: bool = False) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Piece wraps a tensor, not {type(tensor).__name__}")
        shape = tuple(tensor.shape)
        if replicated:
            if offsets is not None or (global_shape is not None and
                                       tuple(global_shape) != shape):
                raise ValueError("a replicated tensor is whole: give no offsets or global_shape")
            global_shape, offsets = shape, (0,) * len(shape)
        if global_shape is None or offsets is None:
            raise ValueError("Piece needs global_shape and offsets (or replicated=True)")
        self.tensor = tensor
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offsets = tuple(int(o) for o in offsets)
        self.replicated = replicated
        check_box(self.global_shape, self.offsets, shape, "Piece")

    def __repr__(self) -> str:
        what = "replicated" if self.replicated else f"at {self.offsets} of {self.global_shape}"
        return f"mpickpt.Piece({tuple(self.tensor.shape)} {what})"



Shard = Piece  # the old name of Piece (a piece of a global tensor; a shard is a rank's file)

def check_box(global_shape: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...],
              what: str) -> None:
    if not (len(global_shape) == len(offsets) == len(shape)):
        raise ValueError(f"{what}: global_shape {global_shape}, offsets {offsets} and the "
                         f"piece's shape {shape} differ in rank")
    for g, o, s in zip(global_shape, offsets, shape, strict=True):
        if o < 0 or s < 0 or o + s > g:
            raise ValueError(f"{what}: the piece {shape} at {offsets} does not lie within "
                             f"{global_shape}")


def is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "to_local")


def local_tensor(x: Any) -> Any:
    """The tensor whose storage holds this rank's piece of ``x`` (``x`` itself if plain)."""
    if type(x) is torch.Tensor:
        return x
    if isinstance(x, Piece):
        return x.tensor
    if is_dtensor(x):
        return x._local_tensor
    return x


def dtensor_placement(t: Any, where: str) -> Placement:
    """The placement of a DTensor's local piece, with the ranks that hold the same piece."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    if any(isinstance(p, Partial) for p in placements):
        raise StateTreeError(f"state[{where}]: a DTensor with a Partial placement holds unreduced "
                             "values; reduce it (redistribute to Replicate or Shard) first")
    if not all(isinstance(p, (Replicate, TShard)) for p in placements):
        raise StateTreeError(f"state[{where}]: DTensor placements {placements} are not supported")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coord = mesh.get_coordinate()
    if coord is None:
        raise StateTreeError(f"state[{where}]: this rank is not in the DTensor's device mesh")
    holders = None  # sharded along every mesh dimension: the piece is this rank's alone
    if any(isinstance(p, Replicate) for p in placements):
        sharded_dims = tuple(d for d, p in enumerate(placements) if isinstance(p, TShard))
        holders = _replica_group(mesh, sharded_dims, tuple(coord))
    return Placement(tuple(t.shape), tuple(offsets), tuple(shape), holders)


@functools.lru_cache(maxsize=256)
def _replica_group(mesh: Any, sharded_dims: tuple[int, ...], coord: tuple[int, ...]
                   ) -> tuple[int, ...]:
    """The ranks of ``mesh`` that share this rank's coordinates along ``sharded_dims``: they hold
    the same piece. Computed once per mesh and placements, not at every save."""
    ranks = mesh.mesh
    return compact(sorted(
        int(ranks[idx]) for idx in itertools.product(*(range(n) for n in ranks.shape))
        if all(idx[d] == coord[d] for d in sharded_dims)
    ))


def compact(ranks: Sequence[int]) -> Sequence[int]:
    """Sorted distinct ``ranks`` as a ``range`` when they are evenly spaced (constant size,
    hashed and compared at once), else as a tuple."""
    if len(ranks) > 1:
        step = ranks[1] - ranks[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(ranks)):
            return range(ranks[0], ranks[-1] + 1, step)
    return tuple(ranks)


def placement_of(x: Any, where: str, replicated: bool, world: int) -> Placement | None:
    """The placement of a state value, or None for a per-rank tensor."""
    if type(x) is torch.Tensor:  # plain (the most common): no DTensor, no Piece
        return whole(tuple(x.shape), world) if replicated else None
    if isinstance(x, Piece):
        holders = range(world) if x.replicated else None
        return Placement(x.global_shape, x.offsets, tuple(x.tensor.shape), holders)
    if is_dtensor(x):
        return dtensor_placement(x, where)
    if replicated:
        return whole(tuple(x.shape), world)
    return None


@functools.lru_cache(maxsize=1 << 12)
def whole(shape: tuple[int, ...], world: int) -> Placement:
    """The placement of a tensor of ``shape`` that each of the ``world`` ranks holds whole (one
    object per shape: a Placement is immutable)."""
    return Placement(shape, (0,) * len(shape), shape, range(world))


# the default Files(min_write_share=): replicated bytes per writer, at least (see writers())
MIN_WRITE_SHARE = 16 << 20


def writers(pieces: Iterable[tuple[str, int, Sequence[int]]], share: int = 0
            ) -> dict[str, int]:
    """Who writes each replicated piece: (name, nbytes, holders) in, name -> rank out.

    Every holder computes the same answer from the same input (the pieces of a replica group are
    the same on all its ranks): within each group of holders, largest pieces first, each to the
    holder with the fewest bytes so far (the lowest rank among equals), so the bytes are spread
    evenly over the holders instead of all falling on the first. ``share`` > 0: a group's
    pieces go to as few of its holders as gives each writer ``share`` bytes or more (at least
    one writer), its highest ranks (rank 0 commits): a small state costs one file's writing and
    syncing, not one per rank. O(T log T) for T pieces, whatever the number of holders: the
    holders given nothing yet wait in rank order.
    """
    groups: dict[Sequence[int], list[tuple[str, int]]] = {}
    for name, nbytes, holders in pieces:
        groups.setdefault(holders, []).append((name, nbytes))
    out: dict[str, int] = {}
    for holders, group in groups.items():
        load: list[tuple[int, int]] = []  # (bytes so far, rank) of the holders given a piece
        ordered = holders if isinstance(holders, range) else sorted(holders)
        if share > 0:
            few = max(1, min(len(ordered), sum(n for _, n in group) // share))
            ordered = ordered[len(ordered) - few:]
        fresh = iter(ordered)
        unused = next(fresh, None)
        for name, nbytes in sorted(group, key=lambda p: (-p[1], p[0])):
            if unused is not None and (not load or (0, unused) < load[0]):
                given, rank, unused = 0, unused, next(fresh, None)
            else:
                given, rank = heapq.heappop(load)
            heapq.heappush(load, (given + nbytes, rank))
            out[name] = rank
    return out


def overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int],
            b_shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes (global offsets and shape), or None if it is empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_off, a_shape, b_off, b_shape,
                                                       strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def flat_span(piece: Sequence[int], box_off: Sequence[int], box_shape: Sequence[int]
              ) -> tuple[int, int]:
    """The element range [first, end) of a row-major piece of shape ``piece`` that holds the box
    at ``box_off`` (relative to the piece) of shape ``box_shape``."""
    count = math.prod(box_shape)
    if count == 0:
        return 0, 0
    if tuple(box_shape) == tuple(piece) and not any(box_off):  # the whole piece (most often)
        return 0, count
    strides = [math.prod(piece[d + 1:]) for d in range(len(piece))]
    first = sum(o * s for o, s in zip(box_off, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(box_off, box_shape, strides, strict=True))
    return first, last + 1


def first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
                  ) -> tuple[int, int] | None:
    """Indices of two non-empty boxes (offsets, shape) that overlap, or None. A sweep along the
    first dimension: only boxes whose row ranges meet are compared (one at a time for FSDP's
    row shards)."""
    order = sorted((i for i, (_, shape) in enumerate(boxes) if math.prod(shape)),
                   key=lambda i: boxes[i][0][:1])
    active: list[int] = []
    for i in order:
        off, shape = boxes[i]
        start = off[0] if off else 0
        active = [j for j in active if not off or boxes[j][0][0] + boxes[j][1][0] > start]
        for j in active:
            if overlap(off, shape, *boxes[j]) is not None:
                return j, i
        active.append(i)
    return None


def writers_of(tensors: dict[str, torch.Tensor], placements: dict[str, Placement],
               share: int = 0) -> dict[str, int]:
    """Who writes each replicated piece of ``tensors`` (what :func:`keep_mine` keeps on each
    rank): name -> rank, for the pieces held by more than one rank (``share``: see
    :func:`writers`)."""
    return _writers_again(tuple(
        (name, tensors[name].nbytes, p.holders) for name, p in placements.items()
        if p.holders is not None and len(p.holders) > 1), share)


@functools.lru_cache(maxsize=4)
def _writers_again(pieces: tuple[tuple[str, int, Sequence[int]], ...], share: int
                   ) -> dict[str, int]:
    """:func:`writers`, the answer kept for the same pieces: a training loop saves the same
    pieces every time, and sorting them again cost 0.8 µs a piece (shared: never changed)."""
    return writers(pieces, share)


def keep_mine(tensors: dict[str, torch.Tensor], placements: dict[str, Placement],
              rank: int, share: int = 0) -> None:
    """Drop from ``tensors`` the replicated pieces another holder writes (DDP: each rank writes
    about 1/N of the model, or the highest ranks all of a small one: ``share``). The pieces of
    each replica group are spread over its ranks by :func:`writers`, which every holder
    computes alike."""
    for name, writer in writers_of(tensors, placements, share).items():
        if writer != rank:
            del tensors[name]


def check_coverage(pieces: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...],
                                                tuple[int, ...], str]]]) -> None:
    """Raise ValueError unless the written pieces of each sharded tensor tile it exactly.

    ``pieces``: name -> [(rank, global_shape, offsets, shape, dtype)] over all ranks' records."""
    for name, ps in pieces.items():
        g, dtype = ps[0][1], ps[0][4]
        volume = 0
        for rank, gs, off, shape, dt in ps:
            if gs != g or dt != dtype:
                raise ValueError(f"tensor {name!r}: rank {rank} holds a piece of {dt}{list(gs)}, "
                                 f"rank {ps[0][0]} of {dtype}{list(g)}")
            check_box(gs, off, shape, f"tensor {name!r} on rank {rank}")
            volume += math.prod(shape)
        clash = first_overlap([(p[2], p[3]) for p in ps])
        if clash is not None:
            a, b = (ps[k] for k in clash)
            raise ValueError(f"tensor {name!r}: the pieces of rank {a[0]} ({list(a[3])} at "
                             f"{list(a[2])}) and rank {b[0]} ({list(b[3])} at {list(b[2])}) "
                             "overlap")
        if volume != math.prod(g):
            raise ValueError(f"tensor {name!r}: the ranks' pieces hold {volume} of its "
                             f"{math.prod(g)} elements; every element must be held by exactly "
                             "one piece (pieces that overlap, or are missing, or a rank that "
                             "declared it replicated while the others did not)")
