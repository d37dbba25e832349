"""The checkpoint metadata at scale, simulated: P ranks x T tensors through the real manifest code.

No processes: synthetic tensor records (names, shapes, a checksum, the piece of a sharded tensor
each rank holds) for P ranks go through the code a save and a restore run today:

- rank 0's commit: the ranks' entries as they arrive (JSON bytes that reach rank 0),
  ``Manifest.assemble`` (the checks) and ``to_json`` (the MANIFEST.json written);
- each rank's restore: ``Manifest.from_json`` of the whole MANIFEST.json (parse and checks), in a
  process of its own: its time and how much its resident memory grew (the parsed manifest kept).

Today every rank reads every rank's records, so the cost grows as P x T; sizes this machine
cannot hold are extrapolated from the measured ones along that line (said so in the table).

    python bench/sim_metadata.py                     # P = 100, 300, 1000; T = 1000 (~5 min)
    python bench/sim_metadata.py --ranks 3000,10000 --formats per-rank --extrapolate 100000
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
from bench_cpu import columns

from mpickpt.format import checksum
from mpickpt.format.entry import IndexRef, RankEntry
from mpickpt.format.manifest import NAME, Manifest
from mpickpt.format.names import INDEX_DIR, index_name, shard_name
from mpickpt.format.records import TensorRecord


def entry(rank: int, ranks: int, tensors: int) -> RankEntry:
    """Rank ``rank``'s entry: ``tensors`` records, each this rank's row-piece of a tensor
    sharded over all ranks (as FSDP stores them), with a tree that lists them."""
    recs, items, offset = [], [], 0
    for i in range(tensors):
        name = f"model/layers.{i // 8}.block{i % 8}.weight"
        rows = 8
        nbytes = rows * 1024 * 2
        recs.append(TensorRecord(name, "bfloat16", [rows, 1024], offset, nbytes,
                                 [f"{(rank * 7919 + i) & 0xFFFFFFFFFFFFFFFF:016x}"],
                                 [rows * ranks, 1024], [rows * rank, 0]))
        items.append([name[6:], {"type": "tensor", "name": name, "device": "cuda:0"}])
        offset += nbytes
    tree = {"type": "dict", "items": [["model", {"type": "dict", "items": items}]]}
    return RankEntry(rank, shard_name(rank), offset + (1 << 20), tree, recs)


def measure(ranks: int, tensors: int, directory: str, split: bool) -> dict[str, Any]:
    """One size, the inline format (version 1) or per-rank index parts (version 2)."""
    ckpt = os.path.join(directory, f"sim-ckpt-{ranks}")
    shutil.rmtree(ckpt, ignore_errors=True)
    os.makedirs(os.path.join(ckpt, INDEX_DIR))
    payloads = []
    for r in range(ranks):  # what each rank sends rank 0 (and, split, writes first)
        e = entry(r, ranks, tensors)
        if split:
            data = json.dumps(e.to_dict()).encode()
            with open(os.path.join(ckpt, index_name(r)), "wb") as f:
                f.write(data)
            e.index = IndexRef(index_name(r), len(data), checksum.digest(data))
            payloads.append(e.summary())
        else:
            payloads.append(e.to_dict())
    gathered = sum(len(json.dumps(e)) for e in payloads)
    t = time.perf_counter()
    m = Manifest.assemble(1, ranks, "sim", payloads, {}, checksum.DEFAULT_BLOCK, ckpt)
    assemble = time.perf_counter() - t
    t = time.perf_counter()
    text = m.to_json()
    to_json = time.perf_counter() - t
    path = os.path.join(ckpt, NAME)
    with open(path, "w") as f:
        f.write(text)
    del m, payloads, text
    try:  # a rank's restore, in a process of its own: its time and its memory
        out = subprocess.run([sys.executable, __file__, "--parse", path], check=True,
                             capture_output=True, text=True).stdout
    finally:
        size = os.path.getsize(path)
        part = os.path.getsize(os.path.join(ckpt, index_name(0))) if split else 0
        shutil.rmtree(ckpt, ignore_errors=True)
    parsed = json.loads(out)
    return {"format": "per-rank index" if split else "inline", "ranks": ranks,
            "tensors": tensors, "gathered_bytes": gathered, "manifest_bytes": size,
            "commit_s": assemble + to_json, "restore_read_bytes": size + part,
            "restore_parse_s": parsed["parse_s"], "restore_peak_bytes": parsed["peak_bytes"],
            "measured": True}


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse(path: str) -> None:
    """Read and parse one MANIFEST.json as a restoring rank does; print the seconds and how much
    the resident memory grew over the parse (the text is read first; the manifest is kept, as
    a restore keeps it)."""
    with open(path, "rb") as f:
        text = f.read()
    before = rss()
    t = time.perf_counter()
    m = Manifest.from_json(text, path)
    _ = m.ranks[0].tensors  # rank 0's own records (from its index part, if split)
    took = time.perf_counter() - t
    grown = rss() - before
    assert m.world_size > 0
    print(json.dumps({"parse_s": took, "peak_bytes": grown}))


def extrapolate(rows: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """Along the line (a + b x ranks) through the two largest measured rows of one format."""
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
    ap.add_argument("--ranks", default="100,300,1000")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--extrapolate", default="10000,100000")
    ap.add_argument("--formats", default="inline,per-rank")
    ap.add_argument("--json", default="bench/results/sim-metadata.json")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--parse", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.parse:
        parse(args.parse)
        return
    rows = []
    for split in [f == "per-rank" for f in args.formats.split(",")]:
        measured = []
        for p in (int(x) for x in args.ranks.split(",")):
            measured.append(measure(p, args.tensors, args.dir, split))
            print(f"{measured[-1]['format']}, {p} ranks measured: parse "
                  f"{measured[-1]['restore_parse_s']:.2f} s", flush=True)
        rows += measured
        rows += [extrapolate(measured, int(x)) for x in args.extrapolate.split(",") if x]
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(columns(
        ("format", "ranks", "x tensors", "", "to rank 0 MB", "MANIFEST MB", "rank 0 commit s",
         "each rank reads MB", "parse s", "parse RSS +MB"),
        [(r["format"], str(r["ranks"]), str(r["tensors"]),
          "measured" if r["measured"] else "extrapolated",
          f"{r['gathered_bytes'] / 1e6:.3f}", f"{r['manifest_bytes'] / 1e6:.3f}",
          f"{r['commit_s']:.3f}", f"{r['restore_read_bytes'] / 1e6:.3f}",
          f"{r['restore_parse_s']:.3f}", f"{r['restore_peak_bytes'] / 1e6:.0f}") for r in rows]))


if __name__ == "__main__":
    main()
