"""XOR parity of a team (:mod:`mpickpt.local.topology` cuts the shards into chunks): made from the
snapshot while the shards are written, or from the shard files; and a lost member rebuilt.

Every member's shard is taken as its file's bytes up to its size, zeros past it. A shard's file
on the level holds its tensors' bytes, HDF5's metadata and zeros between them
(:meth:`~mpickpt.format.shard.ShardWriter.seal` zeroes a recycled file's alignment padding), so
the parity can be made in two passes whose XOR is the parity of the files:

1. :func:`from_snapshot`: while the shard is written, its tensors' bytes go to the other
   members by direct transfers (:mod:`mpickpt.local.xordirect`) straight from the snapshot,
   each once it has landed in host memory; the layout (a template's,
   :mod:`mpickpt.format.h5template`) fixes their offsets and the file's size before a byte
   is written;
2. :func:`add_metadata`: once every shard is sealed, the team's HDF5 metadata (a few kilobytes
   a member, gathered) is XORed into the parity where it falls.

:func:`from_files` makes it from the shard files instead, after the write (a layout without a
template: compressed tensors); :func:`xor_rebuild` reads the files, whichever way the parity
was made, around the ring (:mod:`mpickpt.local.xorring`). Collective over the team (MPI only
through :class:`~mpickpt.mpi.protocol.Protocol`).
"""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..mpi.protocol import Protocol
from . import xordirect, xorring
from .filemap import FileMap, Keep, file_parts
from .topology import xor_chunk

Into = Callable[[xorring.Block], np.ndarray]
Buffer = Callable[[str, int], memoryview]


@dataclass(frozen=True)
class Run:
    """Bytes of a shard at ``offset`` in its file, in host memory at ``addr``."""

    offset: int
    data: np.ndarray  # uint8
    addr: int


def _overlaps(runs: list[Run], starts: list[int], lo: int, hi: int
              ) -> Iterator[tuple[Run, int, int]]:
    """Each run of ``runs`` (sorted by offset; ``starts``, their offsets) that holds shard
    bytes of ``[lo, hi)``, with the part ``[a, b)`` of them it holds."""
    i = max(0, bisect_right(starts, lo) - 1)
    while i < len(runs) and runs[i].offset < hi:
        r = runs[i]
        a, b = max(lo, r.offset), min(hi, r.offset + r.data.nbytes)
        if a < b:
            yield r, a, b
        i += 1


def snapshot_parts(runs: list[Run], gate: Callable[[int, int], object] | None, keep: Keep
                   ) -> Callable[[int, int], xorring.Parts]:
    """The runs of shard bytes ``[start, start + n)`` that ``runs`` hold (sorted by offset),
    each once ``gate(addr, end)`` says it has landed; none once ``keep`` has an error (the
    save fails: its parity is not used)."""
    starts = [r.offset for r in runs]

    def parts(start: int, n: int) -> xorring.Parts:
        out: xorring.Parts = []
        for r, lo, hi in _overlaps(runs, starts, start, start + n):
            if keep.error is not None:
                break
            if gate is not None:
                keep.do(gate, r.addr + lo - r.offset, r.addr + hi - r.offset)
            if keep.error is None:
                out.append((lo - start, r.data[lo - r.offset:hi - r.offset]))
        return out

    return parts


def landing_order(runs: list[Run], n: int, me: int, chunk: int, window: int
                  ) -> list[tuple[int, int]]:
    """The host addresses ``[addr, end)`` of ``runs`` in the order :func:`from_snapshot`'s
    rounds (:func:`~mpickpt.local.xordirect.rounds`) take them from member ``me`` of a team
    of ``n``: a block of each of its chunks per round. For its snapshot's landing to follow
    (:meth:`mpickpt.save.landing.Landing.prefer`), so that a round need not wait for the last
    chunk's bytes to land after all the first's."""
    starts = [r.offset for r in runs]
    out: list[tuple[int, int]] = []
    for rnd in xordirect.rounds(n, chunk, window):
        for j, b in rnd:
            if j != me:
                continue
            lo = xor_chunk(n, me, b.k) * chunk + b.off
            out += [(r.addr + a - r.offset, r.addr + e - r.offset)
                    for r, a, e in _overlaps(runs, starts, lo, lo + b.n)]
    return out


def from_snapshot(team: Protocol, chunk: int, parts: Callable[[int, int], xorring.Parts],
                  into: Into, buffer: Buffer, window: int, on_block: Callable[[], None]) -> None:
    """Pass 1: this member's parity of the team's tensor bytes into ``into(block)``; its own
    tensor bytes from ``parts(start, n)`` (:func:`snapshot_parts`)."""
    n, me = team.size, team.rank
    xordirect.direct(team, chunk, xordirect.block_bytes(n, window),
                     lambda b: parts(xor_chunk(n, me, b.k) * chunk + b.off, b.n), into,
                     xorring.passing(buffer, window), "the XOR parity", on_block)


def add_metadata(parity: np.ndarray, chunk: int, me: int,
                 team_runs: list[list[tuple[int, bytes]]]) -> None:
    """Pass 2: XOR every other member's HDF5 metadata (``team_runs[j]``: member ``j``'s
    ``(offset, bytes)`` runs) into this member's ``parity`` (``chunk`` bytes) where it falls."""
    n = len(team_runs)
    for j, runs in enumerate(team_runs):
        if j == me:
            continue
        lo = xor_chunk(n, j, me) * chunk
        for off, data in runs:
            a, b = max(off, lo), min(off + len(data), lo + chunk)
            if a < b:
                src = np.frombuffer(data, dtype=np.uint8, count=b - a, offset=a - off)
                xorring.xor_into(parity[a - lo:b - lo], src)


def from_files(team: Protocol, own: str, size: int, chunk: int, into: Into, buffer: Buffer,
               window: int, on_block: Callable[[], None]) -> None:
    """The parity of the team's shard files (``own``: this member's, ``size`` bytes), by
    direct transfers: each member's chunks go out of its file's map, the XOR of the team's
    chunks for this member comes into ``into(block)``."""
    with FileMap(own, size) as src:
        src.populate()
        from_snapshot(team, chunk, lambda start, k: file_parts(src, start, k), into, buffer,
                      window, on_block)


def xor_rebuild(team: Protocol, lost: int, chunk: int, sizes: list[int], own: str | None,
                parity: str | None, out_shard: str | None, out_parity: str | None,
                window: int, buffer: Buffer, on_window: Callable[[], None] = lambda: None,
                shard: bool = True, parity_too: bool = True,
                land: Callable[[int, int], np.ndarray] | None = None) -> int:
    """Rebuild the shard and (``parity_too``) the parity of team position ``lost`` on that
    member, from the others' shards (``own``) and parities, over the ring
    (:mod:`mpickpt.local.xorring`): every block ends at the lost member, straight in its new
    files' maps, the shard's blocks in file order and then the parity's (without ``shard``,
    the parity alone); with ``land``, the shard's bytes ``[at, at + n)`` of its file are
    received into ``land(at, n)`` instead (:class:`mpickpt.local.xorlanding.XorLanding`: straight
    into a restore; no file). Collective over ``team``. Bytes received."""
    n, me = team.size, team.rank
    shard_order = sorted((k for k in range(n) if k != lost), key=lambda k: xor_chunk(n, lost, k))
    order = xorring.blocks([*(shard_order if shard else []), *([lost] if parity_too else [])],
                           chunk, window)
    keep = Keep()  # a file that cannot be had: zeros or a scratch buffer, the error after
    with contextlib.ExitStack() as files:

        def opened(path: str | None, size: int, create: bool = False) -> FileMap | None:
            if path is None or keep.error is not None:
                return None
            try:
                f = files.enter_context(FileMap(path, size, create=create))
            except OSError as e:
                keep.error = e
                return None
            return f

        mine = me == lost  # its shard's map as long as its chunks, cut to size once filled
        out = opened(out_shard, (n - 1) * chunk, True) if mine and shard and not land else None
        par = opened(out_parity, chunk, True) if mine and parity_too else None
        src = opened(own, sizes[me]) if not mine else None
        par_src = opened(parity, chunk) if not mine and shard else None
        for f in (out, par, src, par_src):  # (after every map is made: populating one holds
            if f is not None:               # up making the next, 20-30 ms on an H200 host)
                f.populate()

        def contribution(b: xorring.Block) -> xorring.Parts:
            if me == b.k:
                return file_parts(par_src, b.off, b.n)
            return file_parts(src, xor_chunk(n, me, b.k) * chunk + b.off, b.n)

        def into(b: xorring.Block) -> np.ndarray:
            f, at = (par, b.off) if b.k == lost else (out, xor_chunk(n, lost, b.k) * chunk + b.off)
            if land is not None and b.k != lost:
                return land(at, b.n)
            return f.view(at, b.n) if f is not None else \
                np.frombuffer(buffer("scratch", window), dtype=np.uint8)[:b.n]

        xorring.ring(team, order, contribution, into, xorring.passing(buffer, window),
                     "the XOR rebuild", on_window, ends=lambda _: lost)
        if out is not None:
            keep.do(os.ftruncate, out.fd, sizes[lost])
    keep.check()
    return (sizes[lost] * shard + chunk * parity_too) if me == lost else 0
