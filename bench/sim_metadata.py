"""The checkpoint metadata at scale, simulated: P ranks x T tensors through the real code.

No MPI processes: synthetic entries of P ranks go through the code a save and a restore run:

- **save, per rank**: ``flatten_placed`` and ``keep_mine`` of a live state of T tensors in a
  world of P (what the training thread does), the rank's index part serialized and the summary
  it sends rank 0 (with its replicated records);
- **rank 0's commit**: the summaries as they arrive, the replicated part written
  (``write_replicated``), ``Manifest.assemble`` and ``to_json`` (MANIFEST.json): its time, and
  the index parts and bytes it read (none may be read: only the parts a restoring rank reads
  are on disk, so a commit that read any other would fail);
- **each rank's restore**, in a process of its own: MANIFEST.json read and parsed, then
  ``reshard.plan`` for the last rank against a live state, which reads its own index part and
  the replicated part: time, bytes and parts read, resident memory grown.

Layouts: ``inline`` (version 1: every record in the manifest; the format of 64 ranks and
fewer), ``per-rank`` (an index part per rank) and ``per-node`` (one file and one index part per
node of 8 ranks); each ``sharded`` (FSDP: every rank its rows of each tensor) and
``replicated`` (DDP: every rank holds every tensor, each written once, by one of them).
Sizes this machine cannot hold (the inline manifest of 10,000 ranks) are extrapolated along
the line through the two largest measured ones, and said so.

    python bench/sim_metadata.py                              # ~3 min, 2 GB of memory
    python bench/sim_metadata.py --ranks 1000,10000 --formats per-rank --extrapolate 100000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from bench_cpu import columns

from mpickpt import sharding
from mpickpt.format import checksum, entry
from mpickpt.format.entry import IndexRef, RankEntry
from mpickpt.format.manifest import NAME, Manifest
from mpickpt.format.names import FANOUT, index_name, node_index_name, node_name, shard_name
from mpickpt.format.records import TensorRecord
from mpickpt.format.state_tree import flatten_placed
from mpickpt.save.assemble import replicated_records, write_replicated

PER_NODE = 8
ROWS, COLS = 8, 1024  # each tensor's piece: 8 x 1024 bfloat16 (16 KiB)


def names(tensors: int) -> list[str]:
    return [f"layers.{i // 8}.block{i % 8}.weight" for i in range(tensors)]


def live_state(layout: str, rank: int, ranks: int, tensors: int) -> dict[str, Any]:
    """What a rank holds: every tensor whole (replicated) or its rows of each (sharded)."""
    model: dict[str, Any] = {}
    for n in names(tensors):
        t = torch.empty(ROWS, COLS, dtype=torch.bfloat16)
        model[n] = t if layout == "replicated" else sharding.Piece(
            t, (ROWS * ranks, COLS), (ROWS * rank, 0))
    return {"model": model}


class Layout:
    """The synthetic checkpoint of one (format, layout, P, T), built the way ranks build it."""

    def __init__(self, fmt: str, layout: str, ranks: int, tensors: int) -> None:
        self.fmt, self.layout, self.ranks, self.tensors = fmt, layout, ranks, tensors
        self.names = [f"model/{n}" for n in names(tensors)]
        nbytes = ROWS * COLS * 2
        self.writer = sharding.writers((n, nbytes, range(ranks)) for n in self.names) \
            if layout == "replicated" else {}
        self.by_writer: dict[int, list[str]] = {}
        for n, w in self.writer.items():
            self.by_writer.setdefault(w, []).append(n)
        whole = sharding.Placement((ROWS, COLS), (0, 0), (ROWS, COLS), range(ranks))
        self.placements = {n: whole for n in self.writer}  # every rank holds each (replicated)
        self.tree = {"type": "dict", "items": [["model", {"type": "dict", "items": [
            [n[6:], {"type": "tensor", "name": n, "device": "cuda:0"}] for n in self.names]}]]}

    def file(self, rank: int) -> str:
        if self.fmt == "per-node":
            return node_name(rank // PER_NODE, -(-self.ranks // PER_NODE))
        return shard_name(rank, self.ranks)

    def records(self, rank: int) -> list[TensorRecord]:
        """The records rank ``rank`` writes."""
        mine = self.by_writer.get(rank, []) if self.layout == "replicated" else self.names
        out, offset = [], 0
        for i, n in enumerate(mine):
            nbytes = ROWS * COLS * 2
            g, o = ([ROWS, COLS], [0, 0]) if self.layout == "replicated" else (
                [ROWS * self.ranks, COLS], [ROWS * rank, 0])
            out.append(TensorRecord(n, "bfloat16", [ROWS, COLS], offset, nbytes,
                                    [f"{(rank * 7919 + i) & 0xFFFFFFFFFFFFFFFF:016x}"], g, o))
            offset += nbytes
        return out

    def size(self, rank: int) -> int:
        """The exact size of the file ``rank``'s records lie in."""
        if self.fmt == "per-node":  # one file for the node's ranks: every entry gives its size
            return PER_NODE * self.tensors * ROWS * COLS * 2 + (1 << 20)
        count = len(self.by_writer.get(rank, [])) if self.layout == "replicated" \
            else self.tensors
        return count * ROWS * COLS * 2 + (1 << 20)

    def entry(self, rank: int) -> RankEntry:
        return RankEntry(rank, self.file(rank), self.size(rank), self.tree, self.records(rank))

    def part(self, rank: int) -> tuple[str, bytes]:
        """The index part that holds ``rank``'s entry: its name and bytes."""
        if self.fmt == "per-node":
            node, nodes = rank // PER_NODE, -(-self.ranks // PER_NODE)
            first = node * PER_NODE
            members = range(first, min(first + PER_NODE, self.ranks))
            d = {"ranks": [self.entry(r).to_dict() for r in members]}
            return node_index_name(node, nodes), json.dumps(d).encode()
        return index_name(rank, self.ranks), json.dumps(self.entry(rank).to_dict()).encode()

    def payload(self, rank: int, ref: IndexRef | None) -> dict[str, Any]:
        """What rank ``rank`` sends rank 0 (its summary, or inline its whole entry)."""
        if self.fmt == "inline":
            return self.entry(rank).to_dict()
        d = RankEntry(rank, self.file(rank), self.size(rank), index=ref).summary()
        if rank in self.by_writer:  # a writer of replicated tensors: its records of them
            shared = replicated_records(self.entry(rank), self.placements, self.ranks)
            if shared is not None:
                d["replicated"] = shared
        return d


def save_side(layout: str, ranks: int, tensors: int, fmt: str) -> float:
    """Seconds of one rank's metadata work at a save: flatten and keep_mine of its live state
    in a world of ``ranks``, its index part serialized, its summary built."""
    lay = Layout(fmt, layout, ranks, tensors)
    state = live_state(layout, ranks - 1, ranks, tensors)
    t = time.perf_counter()
    _, live, placements = flatten_placed(state, ("model",) if layout == "replicated" else (),
                                         ranks)
    sharding.keep_mine(live, placements, ranks - 1)
    e = lay.entry(ranks - 1)
    data = json.dumps(e.to_dict()).encode()
    e.index = IndexRef("index/x.json", len(data), checksum.digest(data))
    if layout == "replicated":
        replicated_records(e, placements, ranks)
    e.summary()
    return time.perf_counter() - t


def measure(fmt: str, layout: str, ranks: int, tensors: int, directory: str) -> dict[str, Any]:
    lay = Layout(fmt, layout, ranks, tensors)
    ckpt = os.path.join(directory, f"sim-{fmt}-{layout}-{ranks}")
    shutil.rmtree(ckpt, ignore_errors=True)
    os.makedirs(ckpt)
    last = ranks - 1  # the restoring rank measured (not a writer of replicated tensors)
    payloads = []
    written: dict[str, IndexRef] = {}
    for r in range(ranks):
        ref = None
        if fmt != "inline":
            same = r == last or (fmt == "per-node" and r // PER_NODE == last // PER_NODE)
            if same:  # the parts the restore reads are on disk, as the ranks wrote them
                name, data = lay.part(r)
                if name not in written:
                    os.makedirs(os.path.join(ckpt, os.path.dirname(name)), exist_ok=True)
                    with open(os.path.join(ckpt, name), "wb") as f:
                        f.write(data)
                    written[name] = IndexRef(name, len(data), checksum.digest(data))
                ref = written[name]
            else:  # not on disk: the commit and this restore must not read it
                name = node_index_name(r // PER_NODE, -(-ranks // PER_NODE)) \
                    if fmt == "per-node" else index_name(r, ranks)
                ref = IndexRef(name, 2, checksum.digest(b"{}"))
        payloads.append(lay.payload(r, ref))
    gathered = sum(len(json.dumps(p)) for p in payloads)
    before = (entry.parts_read(), entry.metadata_bytes_read())
    t = time.perf_counter()
    replicas = [{"rank": i, **p.pop("replicated")} for i, p in enumerate(payloads)
                if "replicated" in p]
    ref = write_replicated(ckpt, replicas)
    extended = fmt == "per-node" or ranks > FANOUT  # node files, sub-directories: version 3
    m = Manifest.assemble(1, ranks, "sim", payloads, {}, checksum.DEFAULT_BLOCK, ckpt,
                          extended=extended, replicated=ref)
    text = m.to_json()
    commit = time.perf_counter() - t
    read = (entry.parts_read() - before[0], entry.metadata_bytes_read() - before[1])
    with open(os.path.join(ckpt, NAME), "w") as f:
        f.write(text)
    del m, payloads, text
    try:  # a rank's restore, in a process of its own: its time, reads and memory
        out = subprocess.run([sys.executable, __file__, "--restore", ckpt, fmt, layout,
                              str(ranks), str(tensors)], check=True, capture_output=True,
                             text=True).stdout
    finally:
        size = os.path.getsize(os.path.join(ckpt, NAME))
        shutil.rmtree(ckpt, ignore_errors=True)
    got = json.loads(out)
    return {"format": fmt, "layout": layout, "ranks": ranks, "tensors": tensors,
            "gathered_bytes": gathered, "manifest_bytes": size, "commit_s": commit,
            "commit_parts_read": read[0], "commit_bytes_read": read[1],
            "save_rank_s": save_side(layout, ranks, tensors, fmt),
            "restore_read_bytes": got["bytes"], "restore_parts_read": got["parts"],
            "restore_s": got["seconds"], "restore_rss_bytes": got["rss"], "measured": True}


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def restore_side(ckpt: str, fmt: str, layout: str, ranks: int, tensors: int) -> None:
    """The last rank's restore metadata: MANIFEST.json read and parsed, its plan made against
    its live state (own part, replicated part); seconds, bytes and parts read, memory grown
    (the live state is built first and not counted)."""
    from mpickpt.restore import reshard

    rank = ranks - 1
    state = live_state(layout, rank, ranks, tensors)
    before, parts, nbytes = rss(), entry.parts_read(), entry.metadata_bytes_read()
    t = time.perf_counter()
    m = Manifest.read(ckpt)
    plan = reshard.plan(m, rank, ranks, state, ("model",) if layout == "replicated" else (),
                        ckpt)
    took = time.perf_counter() - t
    assert len(plan.targets) == tensors, len(plan.targets)
    print(json.dumps({"seconds": took, "rss": rss() - before,
                      "parts": entry.parts_read() - parts,
                      "bytes": entry.metadata_bytes_read() - nbytes}))


def extrapolate(rows: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """Along the line (a + b x ranks) through the two largest measured rows of one kind."""
    lo, hi = sorted(rows, key=lambda r: r["ranks"])[-2:]
    out = dict(hi)
    for k, v in hi.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (
                "ranks", "tensors"):
            slope = (v - lo[k]) / (hi["ranks"] - lo["ranks"])
            out[k] = max(v + slope * (ranks - hi["ranks"]), 0)
    out.update(ranks=ranks, measured=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1000,10000,100000",
                    help="sizes measured (inline: --inline-ranks)")
    ap.add_argument("--inline-ranks", default="100,300,1000")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--extrapolate", default="",
                    help="sizes extrapolated (inline: 10000 and these)")
    ap.add_argument("--formats", default="inline,per-rank,per-node")
    ap.add_argument("--layouts", default="sharded,replicated")
    ap.add_argument("--json", default="bench/results/sim-metadata.json")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--restore", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.restore:
        ckpt, fmt, layout, ranks, tensors = args.restore
        restore_side(ckpt, fmt, layout, int(ranks), int(tensors))
        return
    rows = []
    for fmt in args.formats.split(","):
        sizes = args.inline_ranks if fmt == "inline" else args.ranks
        extra = ["10000", *args.extrapolate.split(",")] if fmt == "inline" else \
            args.extrapolate.split(",")
        for layout in args.layouts.split(","):
            measured = []
            for p in (int(x) for x in sizes.split(",")):
                measured.append(measure(fmt, layout, p, args.tensors, args.dir))
                r = measured[-1]
                print(f"{fmt} {layout} {p} ranks: commit {r['commit_s']:.2f} s, restore "
                      f"{r['restore_s']:.2f} s", flush=True)
            rows += measured
            if len(measured) >= 2:
                rows += [extrapolate(measured, int(x)) for x in extra if x]
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(columns(
        ("format", "layout", "ranks", "", "to rank 0 MB", "MANIFEST MB", "commit s",
         "commit reads parts/MB", "save/rank s", "restore reads parts/MB", "restore s",
         "restore RSS +MB"),
        [(r["format"], r["layout"], str(r["ranks"]),
          "measured" if r["measured"] else "extrapolated",
          f"{r['gathered_bytes'] / 1e6:.2f}", f"{r['manifest_bytes'] / 1e6:.2f}",
          f"{r['commit_s']:.3f}",
          f"{r['commit_parts_read']:.0f}/{r['commit_bytes_read'] / 1e6:.1f}",
          f"{r['save_rank_s']:.3f}",
          f"{r['restore_parts_read']:.0f}/{r['restore_read_bytes'] / 1e6:.2f}",
          f"{r['restore_s']:.3f}", f"{r['restore_rss_bytes'] / 1e6:.0f}") for r in rows]))


if __name__ == "__main__":
    main()
