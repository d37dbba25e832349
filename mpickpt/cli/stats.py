"""``mpickpt stats ROOT``: the figures of every committed checkpoint, from ``ROOT/stats.jsonl``
(and ``stats.jsonl.1``, the older lines, once it has been rotated).

Rank 0 appends one line per commit: step, time, total bytes, the training thread's stall, rank 0's
persist time and throughput, the commit's duration, and the parts of the shard write. The table
shows them in order of time; ``--plot out.png`` draws stall and throughput per checkpoint on a
timeline in one unit since the first commit (matplotlib, imported only then); an interval more
than five times the median between commits (the job was down) is shaded, no line drawn across
it, and marked in the table. A line cut short by a crash is skipped and reported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..format import rootdir
from ..log import human_bytes
from . import EXIT_ERROR, EXIT_OK
from .catalog import root_problem
from .render import Out, human_span, local_time
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
    with os.fdopen(rootdir.open_regular(path), encoding="utf-8", errors="replace") as f:
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


GAP_FACTOR = 5.0  # an interval this many times the median spacing of commits is a gap
UNITS = (("seconds", 1.0, 180.0), ("minutes", 60.0, 3 * 3600.0), ("hours", 3600.0, 3 * 86400.0),
         ("days", 86400.0, math.inf))


@dataclass
class Timeline:
    """The records on one time axis: ``x`` in ``unit`` since the first commit, with a NaN
    between two commits separated by a gap (so no line is drawn across it), ``index`` the record
    of each x (None at a break), and the gaps as (start, end) in seconds since the first."""

    unit: str
    scale: float
    x: list[float] = field(default_factory=list)
    index: list[int | None] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)


def gaps(times: list[float]) -> list[int]:
    """The indices i where the interval from commit i-1 to commit i is a gap: longer than
    :data:`GAP_FACTOR` times the median interval (the job was down, or stopped saving)."""
    steps = [b - a for a, b in itertools.pairwise(times)]
    if len(steps) < 2:
        return []
    ordered = sorted(steps)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    if median <= 0:
        return []
    return [i + 1 for i, d in enumerate(steps) if d > GAP_FACTOR * median]


def timeline(records: list[dict[str, Any]]) -> Timeline:
    """The x axis of the plot, in one unit chosen by the span (seconds to days)."""
    times = [float(r["time"]) for r in records]
    t0 = times[0] if times else 0.0
    span = (times[-1] - t0) if times else 0.0
    unit, scale = next((u, s) for u, s, limit in UNITS if span < limit)
    tl = Timeline(unit, scale)
    breaks = set(gaps(times))
    for i, t in enumerate(times):
        if i in breaks:
            tl.x.append(math.nan)
            tl.index.append(None)
            tl.gaps.append((times[i - 1] - t0, t - t0))
        tl.x.append((t - t0) / scale)
        tl.index.append(i)
    return tl


def figure(records: list[dict[str, Any]], title: str) -> Any:
    """The matplotlib figure of stall and throughput on the :func:`timeline` (not saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline(records)

    def series(key: str, scale: float) -> list[float]:
        return [math.nan if i is None else (_num(records[i], key) or 0.0) * scale
                for i in tl.index]

    stall, gbps = series("stall_s", 1e3), series("persist_GBps", 1.0)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5), dpi=100)
    ax1.plot(tl.x, stall, "o-", color="tab:red")
    ax1.set_ylabel("training stall (ms)")
    ax1.set_ylim(bottom=0)
    ax2.plot(tl.x, gbps, "s-", color="tab:blue")
    ax2.set_ylabel("persist GB/s (rank 0)")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        for a, b in tl.gaps:
            ax.axvspan(a / tl.scale, b / tl.scale, color="0.85", zorder=0)
    for a, b in tl.gaps:
        ax1.annotate(f"no commits for {human_span(b - a)}", ((a + b) / 2 / tl.scale, 0),
                     xycoords=("data", "axes fraction"), xytext=(0, 4),
                     textcoords="offset points", ha="center", fontsize=7, color="0.3")
    if len(records) <= 30:
        for x, y, i in zip(tl.x, stall, tl.index, strict=True):
            if i is not None:
                ax1.annotate(str(records[i]["step"]), (x, y), textcoords="offset points",
                             xytext=(0, 5), ha="center", fontsize=7)
    t0 = local_time(records[0]["time"]) if records else "-"
    shaded = "; shaded: no commits (job down?)" if tl.gaps else ""
    ax2.set_xlabel(f"{tl.unit} since the first commit ({t0}); labels: step{shaded}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(records: list[dict[str, Any]], png: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(records, title)
    fig.savefig(png)
    plt.close(fig)


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    root = os.path.abspath(args.root)
    path = os.path.join(root, STATS)

    def fail(msg: str) -> int:
        out.problem(msg)
        out.json({"command": "stats", "exit_code": EXIT_ERROR, "error": msg})
        return EXIT_ERROR

    why = root_problem(root)
    if why is not None:
        return fail(why)
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
            rootdir.make_dirs(os.path.dirname(png))
            plot(records, png, f"{root}: {len(records)} checkpoints, steps "
                 f"{records[0]['step']}..{records[-1]['step']}")
        except ImportError:
            return fail("--plot needs matplotlib, which is not installed: pip install "
                        "'mpickpt[plot]'")
        except OSError as e:
            return fail(f"cannot write {png}: {e.strerror or e}")
    breaks = gaps([float(r["time"]) for r in records])
    out.json({"command": "stats", "exit_code": EXIT_OK, "error": None, "root": root,
              "file": path, "records": records, "skipped_lines": skipped, "plot": png,
              "gaps": [{"after_step": records[i - 1]["step"], "before_step": records[i]["step"],
                        "seconds": round(records[i]["time"] - records[i - 1]["time"], 3)}
                       for i in breaks]})
    out.line(f"{out.style('stats', 'bold')} {path}: {len(records)} checkpoint(s)")
    if skipped:
        out.line(f"skipped line(s) {', '.join(map(str, skipped))}: not a complete record "
                 "(cut short by a crash?)")
    if records:
        rows: list[list[str]] = []
        for i, r in enumerate(records):
            if i in breaks:
                gap = human_span(r["time"] - records[i - 1]["time"])
                rows.append(["...", f"({gap} gap)", "", "", "", "", ""])
            rows.append([str(r["step"]), local_time(r["time"]), human_bytes(_num(r, "bytes")),
                         _fmt(_num(r, "stall_s"), 1e3, "ms"),
                         _fmt(_num(r, "persist_s"), 1, "s", 2),
                         _fmt(_num(r, "persist_GBps"), 1, "GB/s", 3),
                         _fmt(_num(r, "commit_s"), 1e3, "ms")])
        out.table(["STEP", "COMMITTED", "SIZE", "STALL", "PERSIST", "RANK 0 GB/s", "COMMIT"],
                  rows, right=(0, 2, 3, 4, 5, 6))
    if png:
        out.line(f"plot: {png}")
    return EXIT_OK
