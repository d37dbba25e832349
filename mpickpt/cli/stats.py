"""``mpickpt stats ROOT``: the figures of every committed checkpoint, from ``ROOT/stats.jsonl``
(and ``stats.jsonl.1``, the older lines, once it has been rotated).

Rank 0 appends one line per commit: step, time, total bytes, the training thread's stall, rank 0's
persist time and throughput, the commit's duration, and the parts of the shard write. The table
shows them in order of time; ``--plot out.png`` draws stall and throughput per checkpoint on a
timeline (matplotlib, imported only then). A line cut short by a crash is skipped and reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime
from typing import Any

from .. import layout
from . import EXIT_ERROR, EXIT_OK
from .render import Out, human_bytes, local_time
from .team import Team

STATS = "stats.jsonl"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("stats", help="stall and throughput of every checkpoint (stats.jsonl)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--plot", metavar="PNG", help="also draw a timeline of stall and throughput")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def read(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a stats.jsonl, in order of time, and the numbers of the lines skipped."""
    records, skipped = [], []
    with os.fdopen(layout.open_regular(path), encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) \
                        or not isinstance(rec.get("time"), (int, float)):
                    raise ValueError("no step or time")
            except (ValueError, RecursionError):
                skipped.append(i)
                continue
            records.append(rec)
    records.sort(key=lambda r: r["time"])
    return records, skipped


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _fmt(v: float | None, scale: float, unit: str, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f} {unit}"


def plot(records: list[dict[str, Any]], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    when = [datetime.fromtimestamp(r["time"]) for r in records]
    stall = [(_num(r, "stall_s") or 0.0) * 1e3 for r in records]
    gbps = [_num(r, "persist_GBps") or 0.0 for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5), dpi=100)
    ax1.plot(when, stall, "o-", color="tab:red")
    ax1.set_ylabel("training stall (ms)")
    ax1.set_ylim(bottom=0)
    ax2.plot(when, gbps, "s-", color="tab:blue")
    ax2.set_ylabel("persist GB/s (rank 0)")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    if len(records) <= 30:
        for w, s, r in zip(when, stall, records, strict=True):
            ax1.annotate(str(r["step"]), (w, s), textcoords="offset points", xytext=(0, 5),
                         ha="center", fontsize=7)
    locator = mdates.AutoDateLocator()
    ax2.xaxis.set_major_locator(locator)
    ax2.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax2.set_xlabel("time of commit (labels: step)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    root = os.path.abspath(args.root)
    path = os.path.join(root, STATS)

    def fail(msg: str) -> int:
        out.problem(msg)
        out.json({"command": "stats", "exit_code": EXIT_ERROR, "error": msg})
        return EXIT_ERROR

    if not os.path.isdir(root):
        return fail(f"{root}: no such directory")
    try:
        records, skipped = read(path)
    except OSError as e:
        return fail(f"{path}: cannot read: {e.strerror} (rank 0 writes it at every commit; "
                    "no checkpoint has committed yet?)")
    older = path + ".1"  # what the Checkpointer rotated out at 16 MiB
    if os.path.lexists(older):
        try:
            more, _ = read(older)
        except OSError as e:
            out.problem(f"{older}: cannot read: {e.strerror}; showing {STATS} alone")
        else:
            records = sorted(more + records, key=lambda r: r["time"])
    png = None
    if args.plot:
        if not records:
            return fail(f"{path} holds no records to plot")
        png = os.path.abspath(args.plot)
        try:
            plot(records, png, f"{root}: {len(records)} checkpoints, steps "
                 f"{records[0]['step']}..{records[-1]['step']}")
        except ImportError:
            return fail("--plot needs matplotlib (pip install matplotlib)")
    out.json({"command": "stats", "exit_code": EXIT_OK, "error": None, "root": root,
              "file": path, "records": records, "skipped_lines": skipped, "plot": png})
    out.line(f"{out.style('stats', 'bold')} {path}: {len(records)} checkpoint(s)")
    if skipped:
        out.line(f"skipped line(s) {', '.join(map(str, skipped))}: not a complete record "
                 "(cut short by a crash?)")
    if records:
        out.table(
            ["STEP", "COMMITTED", "SIZE", "STALL", "PERSIST", "RANK 0 GB/s", "COMMIT"],
            [[str(r["step"]), local_time(r["time"]), human_bytes(_num(r, "bytes")),
              _fmt(_num(r, "stall_s"), 1e3, "ms"), _fmt(_num(r, "persist_s"), 1, "s", 2),
              _fmt(_num(r, "persist_GBps"), 1, "GB/s", 3), _fmt(_num(r, "commit_s"), 1e3, "ms")]
             for r in records], right=(0, 2, 3, 4, 5, 6))
    if png:
        out.line(f"plot: {png}")
    return EXIT_OK
