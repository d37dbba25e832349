"""Restore from the node-local level: the bytes of shards on other nodes, sent by their ranks.

Once :class:`~mpickpt.local.recovery.LocalRecovery` has made a local step whole, every rank's own
shard lies in its node's directory. A rank that needs bytes of a shard written on another node (the
replicated tensors of a DDP job, whose writers are spread over every rank; the pieces of a
sharded tensor) asks that shard's rank for them. Collective over every rank:

1. each rank tells each owner the spans (record, first byte, end) it needs of its shard;
2. each owner maps them out of its own shard (identical requests, as every DDP rank makes, are
   mapped once; compressed records are read and decompressed, verified), and all ranks vote;
3. the bytes move point to point straight into the requesters' buffers, in pieces of at most
   :data:`WINDOW` bytes, received in order a few groups ahead, and each requester verifies
   every block it received against the manifest, where it landed, on its I/O threads while the
   next groups move: end to end (the copy on the serving node and the bytes on the
   way), on the rank that waited for them rather than on the one that sends them and reads its
   own shard meanwhile. A block found damaged names the file it came from and makes this rank's
   part fail: the restore's verify vote then stops every rank before the received bytes are
   used (they are in the restore's buffers, not the state yet).

A rank that could not plan its restore takes part asking for nothing, and the vote stops the
transfer everywhere.

A lost node's shards come the same way, straight into the restore's buffers: their spans are
asked of the rank that holds a partner copy (``servers``), which reads them from that copy; the
files are written back to the lost node after the restore
(:meth:`~mpickpt.local.recovery.LocalRecovery.write_back`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from .. import faults
from ..errors import ShardError
from ..format.iothreads import Batch, start_tasks
from ..format.manifest import Manifest
from ..format.reader import MappedSpans, Span, let_go_behind, read_spans, start_verify_spans
from ..format.records import TensorRecord
from ..mpi.protocol import Protocol
from .ring import Ring

T = TypeVar("T")
WINDOW = 256 << 20  # bytes per message at most
POPULATE_THREADS = 2  # map a served copy's pages in (a pool apart from the I/O threads')
GROUP = 32 << 20  # bytes received, at least, before they are verified (remote._groups)


def _pieces(t: object) -> list[object]:
    """``t`` (a contiguous uint8 tensor, or a memoryview) as buffers of at most :data:`WINDOW`
    bytes."""
    if isinstance(t, torch.Tensor):
        return [t[a: a + WINDOW].numpy() for a in range(0, t.numel(), WINDOW)]
    assert isinstance(t, memoryview)
    return [t[a: a + WINDOW] for a in range(0, len(t), WINDOW)]


def fetch(proto: Protocol, wanted: dict[int, list[Span]], manifest: Manifest, directory: str,
          threads: int, failed: bool, servers: dict[int, int] | None = None,
          served_from: Callable[[int], str] | None = None,
          ring: Ring | None = None) -> tuple[bool, str | None]:
    """Fill the spans of ``wanted`` (shard's rank -> spans of that shard) from the rank that
    serves each shard (its own rank, or in ``servers`` the rank that holds a copy of a lost
    one), verify what came, and serve what others ask of the shards on this rank's node.
    ``failed``: this rank could not plan (it asks for nothing); ``served_from(rank)``: the
    directory that rank serves from (``directory`` if not given), to name a damaged copy;
    ``ring``: the uncompressed spans land in its slots and are copied into place from there
    (:mod:`mpickpt.local.ring`: for destinations in GPU memory).
    (whether every rank's transfer happened and what it received is intact, this rank's
    reason if not); collective."""
    servers = servers or {}
    if ring is not None:  # asked for in pieces of at most a slot
        wanted = {owner: _split(spans, ring.size) for owner, spans in wanted.items()}
    asks: list[list[tuple[int, str, int, int]]] = [[] for _ in range(proto.size)]
    for owner, spans in ({} if failed else wanted).items():
        asks[servers.get(owner, owner)] += [(owner, s.record.name, s.lo, s.hi) for s in spans
                                            if s.nbytes]
    requests = proto.alltoall(asks, "local-ask")
    sends: list[tuple[object, int]] = []
    why = None

    def failure(e: Exception) -> str:
        return str(e) if isinstance(e, ShardError) else \
            f"rank {proto.rank}: {directory}: {type(e).__name__}: {e}"

    mapped: list[MappedSpans] = []
    try:
        sends = _serve(proto.rank, requests, manifest, directory, threads, mapped)
    except Exception as e:
        why = failure(e)
    if not proto.all_ok(why is None and not failed, "local-serve"):
        return False, why
    groups, rings = _groups([(owner, servers.get(owner, owner), s)
                             for owner, spans in wanted.items() for s in spans if s.nbytes],
                            ring.size if ring is not None else 0)
    lands, posts = _posts(groups, rings, ring)

    def before_post(k: int) -> None:
        if ring is not None and rings[k] is not None:
            ring.wait_free(rings[k])

    pending = proto.start_grouped(sends, posts, "local-fetch", before_post=before_post,
                                  peers=sorted({server for g in groups for _, server, _ in g}))
    if any(owner != proto.rank for asked in requests for owner, *_ in asked):
        faults.hit("mid-rebuild", proto.rank, manifest.step)  # serving a lost node's shard
    _populate(mapped)  # (a function: no loop variable here keeps a mapping)
    # each group of spans verified where it landed as soon as it is in, on the I/O threads
    # while the next ones move (compressed ones: by their server, as it decompressed them)
    checks: list[Batch] = []
    try:
        for group, land, r, arrived in zip(groups, lands, rings, pending, strict=False):
            arrived.wait()
            started, error = _use(group, land, ring, r, manifest,
                                  served_from or (lambda _: directory), threads, proto.rank)
            checks += started
            if error is not None:
                why = why or failure(error)
        pending[-1].wait()
    except BaseException:
        if ring is not None:
            ring.abandon()
        for c in checks:
            c.abandon()
        raise
    for c in checks:
        try:
            c.wait()
        except Exception as e:
            why = why or failure(e)
    # the served copies' maps let go behind the vote, which the ranks would wait at for this
    # one (the sends' requests and buffers first: views of them)
    held: list[object] = [sends, pending]
    del sends, pending
    let_go_behind(held, mapped)
    return why is None, why


def _populate(mapped: list[MappedSpans]) -> None:
    """The pages to send mapped in ahead of MPI's copy, while it runs, on threads of their own
    (not ahead of this node's reads)."""
    for m in mapped:
        m.populate(POPULATE_THREADS)


class _Lazy(Sequence[T]):
    """``n`` items, each made by ``make(k)`` when first asked for."""

    def __init__(self, n: int, make: Callable[[int], T]) -> None:
        self._n, self._make = n, make
        self._made: dict[int, T] = {}
        self._lock = threading.Lock()  # (the transfer thread posts, the caller's uses)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k: int) -> T:  # type: ignore[override]
        if not 0 <= k < self._n:
            raise IndexError(k)
        with self._lock:
            if k not in self._made:
                self._made[k] = self._make(k)
            return self._made[k]


def _posts(groups: list[list[tuple[int, int, Span]]], rings: list[int | None],
           ring: Ring | None) -> tuple[_Lazy[list[torch.Tensor]], _Lazy[list[tuple[object, int]]]]:
    """Where each group lands, and its receives ``(buffer, server)``, each made as it is
    posted (a ring slot's page-locked twin is taken where it is made by then)."""
    lands = _Lazy(len(groups), lambda k: _landing(groups[k], ring.slot(rings[k]))
                  if ring is not None and rings[k] is not None
                  else [s.dest for _, _, s in groups[k]])
    return lands, _Lazy(len(groups), lambda k: [
        (b, server) for (_, server, _), d in zip(groups[k], lands[k], strict=True)
        for b in _pieces(d)])


def _use(group: list[tuple[int, int, Span]], land: list[torch.Tensor], ring: Ring | None,
         r: int | None, manifest: Manifest, served_from: Callable[[int], str], threads: int,
         rank: int) -> tuple[list[Batch], Exception | None]:
    """A group that is in: its uncompressed spans verified where they landed (a slot of the
    ring, or in place), by shard and sender, and with a ring copied into place from its slot,
    which is free again once both are done; all started on the I/O threads. (The batches, and
    the error of one that could not start.)"""
    by_source: dict[tuple[int, int], list[Span]] = {}
    for (owner, server, s), d in zip(group, land, strict=True):
        if s.record.codec is None:  # (compressed ones: by their server, as it decompressed)
            by_source.setdefault((owner, server), []).append(Span(s.record, s.lo, s.hi, d))
    started: list[Batch] = []
    error = None
    for (owner, server), spans in by_source.items():
        try:  # the group's spans of one shard from one sender at once
            started.append(start_verify_spans(
                owner, os.path.join(served_from(server), manifest.ranks[owner].file), spans,
                block=manifest.checksum_block, threads=threads, how=f" as rank {server} sent it"))
        except Exception as e:
            error = error or e
    if ring is not None and r is not None:
        started.append(_into_place([(s.dest, d) for (_, _, s), d in zip(group, land, strict=True)],
                                   threads, rank, r))
        ring.release_after(r, [f for b in started for f in b.futures])
    return started, error


def _groups(coming: list[tuple[int, int, Span]], slot: int = 0
            ) -> tuple[list[list[tuple[int, int, Span]]], list[int | None]]:
    """The spans to receive, in order, in groups of at least :data:`GROUP` bytes (the last may
    be less): what is verified at once, as soon as all of it is in (fewer wake-ups than a
    span at a time where tensors are small). With ``slot``, the uncompressed spans go in
    groups of at most ``slot`` bytes of their own, each landing in a slot of the ring. (The
    groups, and each one's number among the ring's groups, or None.)"""
    out: list[list[tuple[int, int, Span]]] = []
    rings: list[int | None] = []
    size, count = GROUP, 0
    for c in coming:
        ringed = bool(slot) and c[2].record.codec is None
        if ringed:
            new = not out or rings[-1] is None or size + c[2].nbytes > slot
        else:
            new = not out or rings[-1] is not None or size >= GROUP
        if new:
            out.append([])
            rings.append(count if ringed else None)
            count += ringed
            size = 0
        out[-1].append(c)
        size += c[2].nbytes
    return out, rings


def _split(spans: list[Span], size: int) -> list[Span]:
    """Uncompressed spans cut into pieces of at most ``size`` bytes (a whole number of
    checksum blocks, so that each piece is verified on its own); the rest as they are."""
    out: list[Span] = []
    for s in spans:
        if s.record.codec is not None:
            out.append(s)
            continue
        out += [Span(s.record, s.lo + a, min(s.lo + a + size, s.hi), s.dest[a:a + size])
                for a in range(0, s.nbytes, size)]
    return out


def _into_place(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int, rank: int,
                r: int) -> Batch:
    """Each ``(destination, slot bytes)`` of ring group ``r`` copied (into the GPU, mostly),
    started on the I/O threads."""
    def task(i: int, _: int) -> None:
        if not i:
            faults.hit("mid-ring-copy", rank, r)
        pairs[i][0].copy_(pairs[i][1])

    return start_tasks([(i, 0) for i in range(len(pairs))], task, threads)


def _landing(group: list[tuple[int, int, Span]], slot: torch.Tensor) -> list[torch.Tensor]:
    """Where each span of a ring group lands: one after another in ``slot``."""
    out, at = [], 0
    for _, _, s in group:
        out.append(slot[at:at + s.nbytes])
        at += s.nbytes
    return out


def _serve(rank: int, requests: list[list[tuple[int, str, int, int]]], manifest: Manifest,
           directory: str, threads: int, mapped: list[MappedSpans]
           ) -> list[tuple[object, int]]:
    """What each rank asked of the shards this rank serves (its own; a copy it holds of a
    lost rank's): uncompressed bytes straight out of the file mapped into memory (their
    receivers verify them), compressed ones decompressed into a buffer and verified (each
    distinct request once). The buffers to send, in the order asked; the mapped spans are
    added to ``mapped``."""
    done: dict[tuple[tuple[int, str, int, int], ...], list[object]] = {}
    sends: list[tuple[object, int]] = []
    records: dict[int, dict[str, TensorRecord]] = {}
    for requester, asked in enumerate(requests):
        if not asked:
            continue
        key = tuple(asked)
        parts = done.get(key)
        if parts is None:
            spans: list[tuple[int, TensorRecord, int, int]] = []
            for owner, name, lo, hi in asked:
                entry = manifest.ranks[owner]
                if owner not in records:
                    records[owner] = {r.name: r for r in entry.tensors}
                rec = records[owner].get(name)
                if rec is None:
                    raise ShardError(owner, os.path.join(directory, entry.file),
                                     f"rank {requester} asked for a tensor this shard does not "
                                     "hold", tensor=name)
                spans.append((owner, rec, lo, hi))
            parts = done[key] = _read(spans, manifest, directory, threads, mapped)
        sends += [(b, requester) for part in parts for b in _pieces(part)]
    return sends


def _read(spans: list[tuple[int, TensorRecord, int, int]], manifest: Manifest, directory: str,
          threads: int, mapped_out: list[MappedSpans]) -> list[object]:
    """Each span's bytes, in order (see :func:`_serve`); the mapped spans are added to
    ``mapped_out``."""
    out: list[object] = [None] * len(spans)
    for owner in sorted({o for o, *_ in spans}):
        entry = manifest.ranks[owner]
        path = os.path.join(directory, entry.file)
        at = [i for i, (o, rec, _, _) in enumerate(spans) if o == owner and rec.codec is None]
        mapped = MappedSpans(owner, path, entry.bytes, [spans[i][1:] for i in at],
                             block=manifest.checksum_block)
        mapped_out.append(mapped)
        for i, v in zip(at, mapped.views, strict=True):
            out[i] = v
        rest = [i for i, (o, rec, _, _) in enumerate(spans) if o == owner and rec.codec]
        if rest:
            bufs = [torch.empty(spans[i][3] - spans[i][2], dtype=torch.uint8) for i in rest]
            read_spans(owner, path, entry.bytes,
                       [Span(spans[i][1], spans[i][2], spans[i][3], b)
                        for i, b in zip(rest, bufs, strict=True)],
                       block=manifest.checksum_block, threads=threads)
            for i, b in zip(rest, bufs, strict=True):
                out[i] = b
    return out
