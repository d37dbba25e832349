"""Plan and carry out one rank's reads of a checkpoint, whatever ranks and sharding wrote it.

Each array the stored tree references gets a *target*: for a sharded or replicated tensor in the
live state, the piece this rank now holds (its placement, :mod:`mpickpt.sharding`); otherwise the
stored per-rank tensor of rank ``r mod N`` as it is, or the whole tensor when only pieces of it
were stored. Every stored piece that overlaps a target is read over the byte range that holds the
overlap, widened to whole checksum blocks so each byte loaded is verified, and no other bytes;
nothing goes through another rank. A stored record that lands whole in one contiguous range of
its target (the same sharding, or rows of a coarser one) is read straight into place.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import sharding
from ..errors import ShardError, StateMismatchError
from ..format import dtypes, state_apply, state_tree
from ..format.blocks import align
from ..format.entry import RankEntry
from ..format.manifest import Manifest
from ..format.reader import MappedSpans, Span, read_spans
from ..format.records import ByteRange
from ..format.shard import TensorRecord
from ..format.state_apply import ArraySpec
from .device_room import DeviceRoom

# a record used where it lies in its file must start on such a boundary (a tensor's elements
# aligned; tensors of 1 MiB and more start on 1 MiB): a smaller one goes through the buffer
MAPPED_ALIGN = 64


class RecordKey(NamedTuple):
    """One stored record: the rank whose shard holds it, and its name. A dict key (a named tuple,
    so that ``for rank, name in plan.spans`` unpacks it)."""

    rank: int
    name: str


@dataclass(frozen=True, slots=True)
class Piece:
    """A stored piece of a sharded or replicated tensor, and the rank whose shard holds it."""

    rank: int
    record: TensorRecord


@dataclass(frozen=True, slots=True)
class Source:
    """What a target takes from one stored record: the overlap box, at global ``offsets`` of
    ``shape``, of record ``record`` of rank ``rank``'s shard."""

    rank: int
    record: TensorRecord
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def key(self) -> RecordKey:
        return RecordKey(self.rank, self.record.name)


@dataclass
class Target:
    """What this rank loads for one name: the box ``offsets``+``shape`` of ``global_shape``."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    sources: list[Source] = field(default_factory=list)

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
    # stored record -> the sorted disjoint byte ranges of it to read, block-aligned
    spans: dict[RecordKey, list[ByteRange]]
    # the entries whose records it reads, by rank (a writer of replicated tensors: maybe only
    # those records, from the manifest's replicated part)
    entries: dict[int, RankEntry] = field(default_factory=dict)
    devices: dict[str, torch.device] = field(default_factory=dict)  # where the state has each
    fresh: set[str] = field(default_factory=set)  # of them, those the state does not hold yet

    def specs(self) -> dict[str, ArraySpec]:
        return {n: ArraySpec(t.dtype, t.shape) for n, t in self.targets.items()}

    @property
    def bytes_to_read(self) -> int:
        return sum(r.nbytes for ranges in self.spans.values() for r in ranges)


def _elements(rec: TensorRecord, off: tuple[int, ...], shape: tuple[int, ...]
              ) -> tuple[int, int]:
    """The element range [first, end) of stored record ``rec`` that holds the box at global
    ``off`` of ``shape``."""
    rel = off if rec.offsets is None else tuple(
        o - s for o, s in zip(off, rec.offsets, strict=True))
    return sharding.flat_span(tuple(rec.shape), rel, shape)


def _merge(ranges: list[ByteRange]) -> list[ByteRange]:
    """The union of ``ranges`` as sorted disjoint ranges (touching ones joined)."""
    out: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: (r.lo, r.hi)):
        if out and r.lo <= out[-1].hi:
            out[-1] = ByteRange(out[-1].lo, max(out[-1].hi, r.hi))
        else:
            out.append(r)
    return out


def plan(manifest: Manifest, rank: int, world: int, state: dict[str, Any],
         replicated: tuple[str, ...], where: str, share: int = 0) -> Plan:
    """Work out what this rank reads from ``manifest`` (at ``where``) to restore ``state``
    (``share``: the saves' Files(min_write_share=), which says whose records hold the
    replicated tensors when the ranks are the same; else every rank's are searched).

    Raises :class:`StateMismatchError` when a sharded tensor of the state does not match the
    stored one (dtype, global shape) and :class:`ShardError` when the stored pieces do not cover
    what this rank needs."""
    source = rank % manifest.world_size
    entry = manifest.ranks[source]
    own = {r.name: r for r in entry.tensors if r.global_shape is None}
    # a state without some replicated tensors (an optimizer before its first step) gets them
    # from the checkpoint: not a typo here (the save checks the key paths)
    _, live, placements = state_tree.flatten_placed(state, replicated, world, strict=False)
    names = state_apply.arrays_of(entry.tree)
    if manifest.world_size == world:
        # the same ranks: this rank's pieces are in its own entry, and the replicated ones in
        # their writers' (those every rank holds: all in the manifest's replicated part, when
        # it has one; the others in their writers' index parts)
        every, some = {source}, {source}
        for name, writer in sharding.writers_of(live, placements, share).items():
            (every if len(placements[name].holders or ()) == world else some).add(writer)
        entries = {r: manifest.replica_entry(r) for r in sorted(every - some)}
        entries |= {r: manifest.ranks[r] for r in sorted(some)}
        try:
            return _plan(manifest, source, names, own, entries, live, placements, where)
        except ShardError:
            pass  # not where they would be: look in every rank's records
    return _plan(manifest, source, names, own, dict(enumerate(manifest.ranks)), live,
                 placements, where)


def _plan(manifest: Manifest, source: int, names: dict[str, str], own: dict[str, TensorRecord],
          entries: dict[int, RankEntry], live: dict[str, torch.Tensor],
          placements: dict[str, sharding.Placement], where: str) -> Plan:
    """:func:`plan` with the stored pieces of ``entries``' records."""
    entry = manifest.ranks[source]
    pieces: dict[str, list[Piece]] = {}
    for e in entries.values():
        for r in e.tensors:
            if r.global_shape is not None:
                pieces.setdefault(r.name, []).append(Piece(e.rank, r))
    targets: dict[str, Target] = {}
    for name in names:
        targets[name] = _target(name, own, pieces, source, live, placements, where)
    block = manifest.checksum_block
    wanted: dict[RecordKey, list[ByteRange]] = {}
    for t in targets.values():
        for s in t.sources:
            item = dtypes.itemsize(s.record.dtype)
            first, end = _elements(s.record, s.offsets, s.shape)
            lo = first * item // block * block
            hi = min(-(-end * item // block) * block, s.record.nbytes)
            wanted.setdefault(s.key, []).append(ByteRange(lo, hi))
    spans = {k: _merge(v) for k, v in wanted.items()}
    devices = {n: t.device for n, t in live.items()
               if n in targets and isinstance(t, torch.Tensor)}
    # a tensor saved from a GPU that the state does not hold yet (a new optimizer's state)
    # goes onto that GPU where the state has tensors there, else onto the one holding most
    cuda = Counter(d for d in devices.values() if d.type == "cuda")
    fresh = {n for n, d in names.items() if cuda and n not in devices and d.startswith("cuda")}
    for n in fresh:
        saved = torch.device(names[n])
        devices[n] = saved if saved in cuda else cuda.most_common(1)[0][0]
    return Plan(source, entry.tree, targets, spans,
                {k.rank: entries[k.rank] for k in spans}, devices, fresh)


def _target(name: str, own: dict[str, TensorRecord],
            pieces: dict[str, list[Piece]], source: int,
            live: dict[str, torch.Tensor], placements: dict[str, sharding.Placement],
            where: str) -> Target:
    placement = placements.get(name)
    if placement is None:
        if name in own:  # a per-rank value, loaded as it was stored
            rec = own[name]
            shape = tuple(rec.shape)
            t = Target(name, rec.dtype, shape, (0,) * len(shape), shape)
            t.sources.append(Source(source, rec, t.offsets, shape))
            return t
        if name not in pieces:
            raise ShardError(source, where, "the stored tree references an array that no rank's "
                             "records hold", tensor=name)
        rec = pieces[name][0].record
        g = tuple(rec.global_shape or ())
        return _cover(Target(name, rec.dtype, g, (0,) * len(g), g), pieces[name], where)
    dtype = dtypes.name_of(live[name].dtype)
    t = Target(name, dtype, placement.global_shape, placement.offsets, placement.shape)
    stored = pieces.get(name)
    if stored is None and name in own and tuple(own[name].shape) == placement.global_shape:
        rec = own[name]  # stored whole by this rank's source rank: one piece at the origin
        stored = [Piece(source, TensorRecord(**{**rec.__dict__, "global_shape": list(rec.shape),
                                                "offsets": [0] * len(rec.shape)}))]
    if stored is None:
        raise StateMismatchError(
            f"state[{name}]: the checkpoint holds no tensor {name!r} of global shape "
            f"{list(placement.global_shape)}")
    rec = stored[0].record
    if rec.dtype != dtype or tuple(rec.global_shape or ()) != placement.global_shape:
        raise StateMismatchError(
            f"state[{name}]: checkpoint holds {rec.dtype}{list(rec.global_shape or [])}, the "
            f"state {dtype}{list(placement.global_shape)}")
    return _cover(t, stored, where)


def _cover(t: Target, stored: list[Piece], where: str) -> Target:
    """Attach the stored pieces overlapping ``t``; they must cover all of it."""
    got = 0
    for p in stored:
        rec = p.record
        if rec.dtype != t.dtype or tuple(rec.global_shape or ()) != t.global_shape:
            raise ShardError(p.rank, where, f"a piece of {rec.dtype}{rec.global_shape} among "
                             f"pieces of {t.dtype}{list(t.global_shape)}", tensor=t.name)
        box = sharding.overlap(t.offsets, t.shape, tuple(rec.offsets or ()), tuple(rec.shape))
        if box is not None:
            off, shape = box
            t.sources.append(Source(p.rank, rec, off, shape))
            got += math.prod(shape)
    clash = sharding.first_overlap([(s.offsets, s.shape) for s in t.sources])
    if clash is not None:  # the stored pieces must not overlap, or their sizes prove nothing
        s = t.sources[clash[1]]
        raise ShardError(s.rank, where, f"its piece {s.record.shape} at {s.record.offsets} "
                         f"overlaps another stored piece of {list(t.global_shape)}",
                         tensor=t.name)
    if got != math.prod(t.shape):
        raise ShardError(t.sources[0].rank if t.sources else 0, where,
                         f"the stored pieces hold {got} of the {math.prod(t.shape)} elements "
                         f"this rank needs (at {list(t.offsets)} of {list(t.global_shape)})",
                         tensor=t.name)
    return t


@dataclass
class Staged:
    """A plan's targets allocated, and the spans to read into them, by the rank whose shard
    holds them: :meth:`read` fills them from files (every block verified), or another rank sends
    them (the node-local level: :mod:`mpickpt.local.remote`); :meth:`finish` assembles the
    targets."""

    plan: Plan
    out: dict[str, torch.Tensor]
    by_rank: dict[int, list[Span]]
    direct: dict[RecordKey, int]  # stored record -> byte offset in its target (read in place)
    staged: dict[RecordKey, list[Span]]  # stored record -> its spans, in byte order
    # target -> the one whole record it is, used where it lies in its file (mapped, verified)
    mapped: dict[str, Source] = field(default_factory=dict)
    # targets in GPU memory of their own, for the state to keep as they are (Plan.fresh)
    owned: set[str] = field(default_factory=set)
    # spans read into GPU memory come through page-locked buffers, one per block (device_room)
    bounce: Callable[[], AbstractContextManager[torch.Tensor]] | None = None
    # the files the mapped targets are views of (closed by whoever lets the targets go)
    maps: list[MappedSpans] = field(default_factory=list)

    def read(self, manifest: Manifest, directory: str, ranks: Iterable[int], *, threads: int,
             on_block: Callable[[], None] | None = None) -> None:
        """Read and verify the spans of these ranks' shards under ``directory``; the targets
        that are :attr:`mapped` become views of their files, every block verified where it
        lies."""
        block = manifest.checksum_block
        for src_rank in ranks:
            entry = self.plan.entries[src_rank]
            by_file: dict[tuple[str, int], list[Span]] = {}  # incremental: some in older shards
            for s in self.by_rank.get(src_rank, []):
                by_file.setdefault(entry.file_of(directory, s.record), []).append(s)
            for (path, size), spans in by_file.items():
                read_spans(src_rank, path, size, spans, block=block, threads=threads,
                           on_block=on_block, bounce=self.bounce)
            whole = [(n, src) for n, src in self.mapped.items() if src.rank == src_rank]
            if whole:
                path, size = os.path.join(directory, entry.file), entry.bytes
                mapped = MappedSpans(src_rank, path, size, [(src.record, 0, src.record.nbytes)
                                                             for _, src in whole], block=block)
                self.maps.append(mapped)
                for (n, src), view in zip(whole, mapped.views, strict=True):
                    self.out[n] = _over(view, src.record)
                mapped.verify(threads)
                if on_block is not None:
                    on_block()

    def finish(self) -> dict[str, torch.Tensor]:
        """Every target, by name, once all spans are in."""
        for n, t in self.plan.targets.items():
            for src in t.sources:
                if src.key not in self.direct:
                    _copy_box(self.out[n], t, src, self.staged[src.key])
        return self.out


def stage(p: Plan, buffer: Callable[[int, bool], torch.Tensor],
          mappable: Callable[[int], bool] | None = None, room: DeviceRoom | None = None
          ) -> Staged:
    """Allocate the targets of ``p`` in one ``buffer(nbytes, to_gpu)`` (``to_gpu``: targets on
    a GPU take their bytes from it) and lay out the spans to read: a record
    that lands whole in one contiguous range of its target is read straight there. A target
    that is one whole record, uncompressed and in the shard of a rank that ``mappable`` accepts
    (a file in memory: the node-local level's own shards), takes no room in the buffer: it is
    used where it lies in its file (:attr:`Staged.mapped`). With ``room``, the targets the
    state has on its GPU whose uncompressed bytes come from other ranks or could be mapped
    get their room there instead, if it has it, and are read into it rather than mapped
    (:mod:`mpickpt.restore.device_room`)."""
    mapped = {n: t.sources[0] for n, t in p.targets.items()
              if mappable is not None and len(t.sources) == 1 and _whole(t, t.sources[0])
              and mappable(t.sources[0].rank)}
    gpu = set() if room is None else {
        n for n, t in p.targets.items() if p.devices.get(n) == room.device
        and all(s.record.codec is None and (n in mapped or room.fetched(s.rank))
                for s in t.sources)}
    alone = sorted(gpu & p.fresh)  # the state keeps these as they are: memory of their own
    at_gpu, gpu_pos = _layout(p, gpu - p.fresh)
    held = room.buffers([gpu_pos, *(p.targets[n].nbytes for n in alone)]) \
        if gpu and room is not None else None
    if held is None:
        gpu, at_gpu, alone = set(), {}, []
    base = {n: held[0] for n in at_gpu} | {n: held[i + 1] for i, n in enumerate(alone)}
    # one with room there is read into it through the page-locked buffers, even from a file in
    # memory: mapped, its pages would be faulted into this process one by one
    mapped = {n: src for n, src in mapped.items() if n not in gpu}
    at_gpu |= dict.fromkeys(alone, 0)
    offsets, pos = _layout(p, set(p.targets) - set(mapped) - gpu)
    to_gpu = any(p.devices[n].type == "cuda" for n in offsets if n in p.devices)
    try:
        buf = buffer(pos, to_gpu) if pos else torch.empty(0, dtype=torch.uint8)
    except BaseException:
        if room is not None:  # the GPU memory it set aside: back now (the caller never gets it)
            room.close()
        raise
    flat = {n: ((base[n] if n in gpu else buf), at) for n, at in (offsets | at_gpu).items()}
    out = {n: b[at: at + p.targets[n].nbytes]
           .view(dtypes.torch_dtype(p.targets[n].dtype)).view(p.targets[n].shape)
           for n, (b, at) in flat.items()}
    direct: dict[RecordKey, int] = {}
    for t in p.targets.values():
        for src in t.sources:
            at = t.in_place(src.record, src.offsets, src.shape)
            if at is not None:
                direct[src.key] = at
    by_rank: dict[int, list[Span]] = {}
    staged: dict[RecordKey, list[Span]] = {}
    for n, t in p.targets.items():
        if n in mapped:
            continue
        for src in t.sources:
            key = src.key
            if key in staged:
                continue
            spans: list[Span] = []
            for r in p.spans[key]:
                if key in direct:  # (a slice of the bytes under out[n]: one op, not three)
                    b, at = flat[n][0], flat[n][1] + direct[key]
                    dest = b[at + r.lo: at + r.hi]
                else:
                    dest = torch.empty(r.nbytes, dtype=torch.uint8)
                spans.append(Span(src.record, r.lo, r.hi, dest))
            by_rank.setdefault(key.rank, []).extend(spans)
            staged[key] = spans
    return Staged(p, out, by_rank, direct, staged, mapped, set(alone))


def _layout(p: Plan, names: set[str]) -> tuple[dict[str, int], int]:
    """Offsets of the targets ``names`` one after another, aligned, and the bytes they take."""
    offsets, pos = {}, 0
    for name, t in p.targets.items():
        if name in names:
            offsets[name] = pos
            pos = align(pos + t.nbytes)
    return offsets, pos


def _whole(t: Target, src: Source) -> bool:
    """Whether ``src`` is all of ``t``: a whole record of the rank's own file, its bytes the
    target's bytes in order."""
    rec = src.record
    return (rec.codec is None and rec.source is None and rec.nbytes == t.nbytes
            and not rec.offset % MAPPED_ALIGN and tuple(rec.shape) == t.shape
            and rec.dtype == t.dtype and t.in_place(rec, src.offsets, src.shape) == 0)


def _over(view: memoryview, rec: TensorRecord) -> torch.Tensor:
    """A read-only file view of ``rec``'s bytes as a tensor of its dtype and shape (no copy;
    restore only reads it, into the state's own tensors)."""
    if not rec.nbytes:
        return torch.empty(rec.shape, dtype=dtypes.torch_dtype(rec.dtype))
    with warnings.catch_warnings():  # not writable: torch only warns, and nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=torch.uint8)
    return flat.view(dtypes.torch_dtype(rec.dtype)).view(rec.shape)


def _copy_box(dest: torch.Tensor, t: Target, src: Source, spans: list[Span]) -> None:
    """Copy the overlap box of ``src`` from the staged ``spans`` of its record."""
    rec, off, shape = src.record, src.offsets, src.shape
    if math.prod(shape) == 0:
        return
    item = dtypes.itemsize(rec.dtype)
    first, _ = _elements(rec, off, shape)
    span = next(s for s in reversed(spans) if s.lo <= first * item)
    flat = span.dest.view(dtypes.torch_dtype(rec.dtype))[first - span.lo // item:]
    strides = tuple(math.prod(rec.shape[d + 1:]) for d in range(len(rec.shape)))
    stored = flat.as_strided(shape, strides, flat.storage_offset())
    box = tuple(slice(o - to, o - to + n) for o, to, n in zip(off, t.offsets, shape, strict=True))
    dest[box].copy_(stored)

