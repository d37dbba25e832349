"""``mpickpt inspect ROOT[/step-XXXXXXXX]``: what a checkpoint holds, from its manifest alone.

Per rank: every tensor's name, dtype, shape, bytes and checksum (xxh3-64 of each block); for the
checkpoint: step, time, world size, run, size and the user metadata given to ``save()``. Rank 0 by
default, ``--rank R`` or ``--all``; ``--tree`` adds each rank's state tree (the non-tensor values:
epoch counters, scheduler settings, ...) as an indented outline, and with ``--json`` as the raw
JSON tree. Reads the manifest and the shards' sizes, not the data.
Exit 0, or 5 when the quick check fails (what the manifest says is still shown when it parses).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..log import human_bytes
from . import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, treeview
from .checks import Unusable, pick
from .render import STATUS_STYLE, Out, human_age, iso_utc, local_time
from .team import Team


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="tensors and metadata of one checkpoint",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("path", metavar="ROOT[/step-XXXXXXXX]",
                   help="a checkpoint directory, or ROOT for the one restore would load")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N under ROOT")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="show rank R (default 0)")
    which.add_argument("--all", action="store_true", help="show every rank")
    p.add_argument("--tree", action="store_true",
                   help="also show each rank's state tree: keys, types, tensor dtypes and "
                   "shapes, values (with --json: the raw JSON tree)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _checksum(sums: list[str]) -> str:
    if not sums:
        return "-"
    return sums[0] if len(sums) == 1 else f"{sums[0]} +{len(sums) - 1} blocks"


def _shape(t: dict[str, Any]) -> str:
    """``[6, 1024]``, or for a piece of a sharded tensor ``[6, 1024] at [0, 0] of [37, 1024]``."""
    if t.get("global_shape") is None:
        return str(t["shape"])
    return f"{t['shape']} at {t['offsets']} of {t['global_shape']}"


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    now = time.time()
    try:
        e = pick(args.path, args.step)
    except Unusable as err:
        out.problem(str(err))
        out.json({"command": "inspect", "exit_code": err.code, "error": str(err)})
        return err.code
    code = EXIT_DAMAGED if e.problems else EXIT_OK
    m = e.manifest
    ranks: list[int] = []
    if m is not None:
        ranks = list(range(m.world_size)) if args.all else [args.rank or 0]
        if ranks[0] >= m.world_size or ranks[0] < 0:
            msg = f"{e.path} has ranks 0..{m.world_size - 1}, not {ranks[0]}"
            out.problem(msg)
            out.json({"command": "inspect", "exit_code": EXIT_ERROR, "error": msg})
            return EXIT_ERROR
    doc = {"command": "inspect", "exit_code": code, "error": None, **e.to_json(now),
           "checksum_algorithm": m.checksum_algorithm if m else None,
           "checksum_block": m.checksum_block if m else None,
           "metadata": m.metadata if m else None, "ranks": []}
    for r in ranks:
        assert m is not None
        entry = m.ranks[r]
        rj: dict[str, Any] = {
            "rank": r, "file": entry.file, "bytes": entry.bytes,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "nbytes": t.nbytes,
                         "offset": t.offset, "checksums": t.checksums,
                         "global_shape": t.global_shape, "offsets": t.offsets}
                        for t in entry.tensors]}
        if args.tree:
            rj["tree"] = entry.tree
        doc["ranks"].append(rj)
    out.json(doc)

    status = out.style(e.status, STATUS_STYLE.get(e.status, ""))
    out.line(f"{out.style(f'step {e.step}', 'bold')}  {e.path}  {status}"
             + ("" if e.problems else " (quick check passed)"))
    for p in e.problems:
        out.line(f"  {out.style('problem', 'red')}   {p.reason}")
    if m is None:
        out.line("the manifest cannot be read, so there is nothing more to show")
        return code
    out.line(f"  written   {local_time(m.created)} ({human_age(now - m.created)}), "
             f"{iso_utc(m.created)}")
    out.line(f"  ranks     {m.world_size}, run {m.run_id}")
    out.line(f"  size      {human_bytes(m.total_bytes)}")
    out.line(f"  checksum  {m.checksum_algorithm} per block of {m.checksum_block} bytes")
    out.line(f"  metadata  {json.dumps(m.metadata)}")
    for rj in doc["ranks"]:
        data = sum(t["nbytes"] for t in rj["tensors"])
        out.line()
        label = out.style(f"rank {rj['rank']}", "bold")
        if rj["file"] is None:  # its replicated tensors are in other ranks' shards
            out.line(f"{label}: no file (it wrote no tensor), {len(rj['tensors'])} tensors")
        else:
            out.line(f"{label}: {rj['file']}, "
                     f"{human_bytes(rj['bytes'])}, {len(rj['tensors'])} tensors, "
                     f"{human_bytes(data)} of tensor data")
        out.table(["NAME", "DTYPE", "SHAPE", "BYTES", "CHECKSUM"],
                  [[t["name"], t["dtype"], _shape(t), str(t["nbytes"]),
                    _checksum(t["checksums"])] for t in rj["tensors"]],
                  right=(3,), indent="  ")
        if args.tree:
            out.line("  state tree:")
            for text in treeview.lines(rj["tree"], m.ranks[rj["rank"]].tensors):
                out.line("    " + text)
    if not args.all and m.world_size > 1:
        out.line()
        out.line(f"(rank {ranks[0]} of {m.world_size}: --rank R for another, --all for every "
                 "rank)")
    return code
