"""The XOR ring alone (``mpickpt.local.xorring``), or the parity by direct transfers
(``mpickpt.local.xordirect``): a team's parity and a lost member's rebuild, on
shards in anonymous memory (no files, no snapshot, no shard being written beside it), against one
transfer of the shard between neighbours through the same Protocol.

    mpiexec -n 3 python bench/probe_xorring.py --mb 2000 [--reps 5] [--no-xor | --direct]
        [--files DIR]

Every rank holds a shard of ``--mb`` MB; the ranks form one team. Rank 0 prints the medians of
its own times: the bound, the parity, and the rebuild of member 1,
each with its ratio to the bound. ``--no-xor``: the blocks go around without being XORed (what
the ring costs without its CPU work; the parity and the rebuilt shard are then not checked).
``--direct``: the parity by direct transfers, as the level makes it (the rebuild is the ring's
either way; every parity is checked against numpy's). ``--files DIR``
(a tmpfs, as ``/dev/shm``): the same through the level's own functions on real files, as a save
and a restore do (``parity.from_files``, by direct transfers, out of each shard file's map
into a parity file;
``parity.xor_rebuild`` of member 1's shard into a new file), the files made before the timing;
with ``--land`` as well, member 1's shard is received into memory touched before instead of a
new file, as a restore lands it (:class:`~mpickpt.local.xorlanding.XorLanding`), so that only
the survivors' side goes through files.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from mpickpt.local import parity, xordirect, xorring
from mpickpt.local.topology import xor_chunk, xor_chunk_bytes
from mpickpt.mpi.protocol import Protocol


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="MB per shard (200)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (5)")
    ap.add_argument("--no-xor", action="store_true", help="pass the blocks on without XOR")
    ap.add_argument("--direct", action="store_true",
                    help="the parity by direct transfers (local/xordirect.py), not the ring")
    ap.add_argument("--files", help="through files in this directory (a tmpfs)")
    ap.add_argument("--land", action="store_true", help="with --files: the rebuilt shard into "
                    "memory touched before, not a new file")
    args = ap.parse_args()
    if args.land and not args.files:
        ap.error("--land goes with --files")
    if args.files:
        files(args)
        return
    proto = Protocol(timeout=120)
    n, me = proto.size, proto.rank
    size = int(args.mb * 1e6)
    shard = np.full(size, me + 1, np.uint8)
    chunk = xor_chunk_bytes(size, n)
    mine_parity = np.zeros(chunk, np.uint8)
    bufs = [np.zeros(xorring.BLOCK, np.uint8) for _ in range(xorring.BUFFERS)]
    peer = np.zeros(size, np.uint8)

    def mine(b: xorring.Block) -> xorring.Parts:
        if args.no_xor:
            return []
        if me == b.k:
            return [(0, mine_parity[b.off:b.off + b.n])]
        start = xor_chunk(n, me, b.k) * chunk + b.off
        out = shard[start:start + b.n]
        return [(0, out)] if out.nbytes else []

    lost, times = 1, []
    out = np.zeros((n - 1) * chunk, np.uint8)  # the lost member's rebuilt shard
    rest = sorted((k for k in range(n) if k != lost), key=lambda k: xor_chunk(n, lost, k))
    order = xorring.interleave([xorring.blocks([k], chunk, xorring.BLOCK) for k in range(n)])
    for _ in range(args.reps):
        tb = timed(proto, "bound", lambda: proto.transfer(
            [(shard, (me + 1) % n)], [(peer, (me - 1) % n)], "bound"))
        mine_parity[:] = 0
        tp = timed(proto, "parity", lambda: xordirect.direct(
            proto, chunk, xorring.BLOCK, mine, lambda b: mine_parity[b.off:b.off + b.n], bufs,
            "parity") if args.direct else xorring.ring(
            proto, order, mine, lambda b: mine_parity[b.off:b.off + b.n], bufs, "parity"))
        if not args.no_xor:  # every other member's shard is its rank + 1, zeros past it
            want = np.zeros(chunk, np.uint8)
            for j in range(n):
                if j != me:
                    lo = xor_chunk(n, j, me) * chunk
                    want[:max(0, min(chunk, size - lo))] ^= j + 1
            assert (mine_parity == want).all(), "the parity differs"
        out[:] = 0
        tr = timed(proto, "rebuild", lambda: xorring.ring(
            proto, xorring.blocks(rest, chunk, xorring.BLOCK), mine,
            lambda b: out[xor_chunk(n, lost, b.k) * chunk + b.off:][:b.n], bufs, "rebuild",
            ends=lambda _: lost))
        if me == lost and not args.no_xor:
            assert (out[:size] == me + 1).all(), "the rebuilt shard differs"
        times.append((tb, tp, tr))
    if me == 0:
        bound, par, reb = (statistics.median(x) for x in zip(*times, strict=True))
        print(f"{n} ranks, {size / 1e6:.0f} MB shards: bound {bound:.3f} s  parity {par:.3f} s "
              f"({par / bound:.2f}x)  rebuild {reb:.3f} s ({reb / bound:.2f}x)", flush=True)


def timed(proto: Protocol, phase: str, fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes on this rank, every rank starting it after a barrier."""
    proto.barrier(phase)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def files(args: argparse.Namespace) -> None:
    """``--files``: the parity and a rebuild through the level's functions, on files."""
    proto = Protocol(timeout=120)
    n, me = proto.size, proto.rank
    size = int(args.mb * 1e6)
    own = os.path.join(args.files, f"probe-xor-{me}.bin")
    par = os.path.join(args.files, f"probe-xor-parity-{me}.bin")
    np.full(size, me + 1, np.uint8).tofile(own)
    chunk = xor_chunk_bytes(size, n)
    bufs: dict[str, np.ndarray] = {}

    def buffer(name: str, nbytes: int) -> memoryview:
        if name not in bufs or bufs[name].nbytes < nbytes:
            bufs[name] = np.zeros(nbytes, np.uint8)
        return memoryview(bufs[name])[:nbytes]

    with open(par, "wb") as f:
        f.truncate(chunk)
    dst = np.memmap(par, np.uint8, "r+", shape=(chunk,))  # kept mapped, as the level's are
    dst[:] = 0
    lost, times = 1, []
    landed = np.zeros((n - 1) * chunk if args.land and me == lost else 0, np.uint8)
    try:
        peer, src = np.zeros(size, np.uint8), np.fromfile(own, np.uint8)
        out = os.path.join(args.files, f"probe-xor-rebuilt-{me}.bin")
        for _ in range(args.reps):
            tb = timed(proto, "bound", lambda: proto.transfer(
                [(src, (me + 1) % n)], [(peer, (me - 1) % n)], "bound"))
            tp = timed(proto, "parity", lambda: parity.from_files(
                proto, own, size, chunk, lambda b: dst[b.off:b.off + b.n], buffer,
                xorring.BLOCK, lambda: None))
            dst.flush()
            landed[:] = 0
            tr = timed(proto, "rebuild", lambda: parity.xor_rebuild(
                proto, lost, chunk, [size] * n, own if me != lost else None,
                par if me != lost else None, out if me == lost else None, None, xorring.BLOCK,
                buffer, parity_too=False,
                land=(lambda at, k: landed[at:at + k]) if args.land else None))
            if me == lost and args.land:
                assert (landed[:size] == me + 1).all(), "the rebuilt shard differs"
            elif me == lost:
                got = np.fromfile(out, np.uint8)
                assert got.nbytes == size and (got == me + 1).all(), "the rebuilt shard differs"
                os.unlink(out)
            times.append((tb, tp, tr))
    finally:
        for path in (own, par):
            os.unlink(path)
    if me == 0:
        bound, p, r = (statistics.median(x) for x in zip(*times, strict=True))
        into = ", rebuilt into memory" if args.land else ""
        print(f"{n} ranks, {size / 1e6:.0f} MB shards, files in {args.files}{into}: "
              f"bound {bound:.3f} s"
              f"  parity {p:.3f} s ({p / bound:.2f}x)  rebuild {r:.3f} s ({r / bound:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
