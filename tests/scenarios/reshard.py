"""Save declared-sharded, replicated and per-rank tensors on N ranks; restore on M and check.

Usage: reshard.py save|restore ROOT REPORTS [--block B] [--index auto|inline|per-rank]
                  [--files per-rank|per-node] [--fanout N] [--per-node K]

The global tensors are pure functions of their shape, so any rank can check its piece:
- ``rows``: float32 (37, 1024), split over the ranks by uneven row ranges (see ``row_split``);
- ``cols``: int64 (8, 30), split over the ranks by uneven column ranges;
- ``rep``: float64 (3, 5000) that every rank holds alike (Checkpointer(replicated=("rep",)));
- ``mine``: a per-rank tensor whose values depend on the rank that saved it;
- ``note``: a per-rank string.
Each rank writes REPORTS/<mode>-rank-R.json with the restored step, what matched, the bytes its
restore read, the bytes its pieces need and the index parts it read (with --index per-rank).

Run by tests/multirank/test_reshard.py, tests/multirank/test_index.py (with --index
per-rank), tests/multirank/test_node_files.py (--files per-node, nodes of --per-node ranks)
tests/cli/test_cli_export_sharded.py (which also imports :func:`whole`) and
tests/multirank/test_torchrun.py (4 torchrun ranks, then 2); named for the first, whose subject it
is.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
from _report import write_report
from _world import World

import mpickpt
import mpickpt.format.entry

ROWS, COLS, REP = (37, 1024), (8, 30), (3, 5000)


def row_split(n: int, total: int) -> list[tuple[int, int]]:
    """Uneven ranges: rank i gets a share proportional to i + 1."""
    weights = [i + 1 for i in range(n)]
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + total * w // sum(weights))
    cuts[-1] = total
    return list(itertools.pairwise(cuts))


def whole(name: str) -> torch.Tensor:
    if name == "rows":
        return torch.arange(ROWS[0] * ROWS[1], dtype=torch.float32).reshape(ROWS) / 7
    if name == "cols":
        return torch.arange(COLS[0] * COLS[1], dtype=torch.int64).reshape(COLS) * 3 - 11
    return torch.linspace(-1, 1, REP[0] * REP[1], dtype=torch.float64).reshape(REP)


def make_state(rank: int, world: int, fill: bool) -> dict:
    r0, r1 = row_split(world, ROWS[0])[rank]
    c0, c1 = row_split(world, COLS[1])[world - 1 - rank]  # the other way round
    rows, cols, rep = whole("rows")[r0:r1].clone(), whole("cols")[:, c0:c1].clone(), whole("rep")
    mine = torch.full((4,), float(rank))
    if not fill:
        rows.zero_(), cols.zero_(), mine.zero_()
        rep = torch.zeros(REP, dtype=torch.float64)
    return {
        "rows": mpickpt.Piece(rows, ROWS, (r0, 0)),
        "cols": mpickpt.Piece(cols, COLS, (0, c0)),
        "rep": rep,
        "mine": mine,
        "note": f"saved by rank {rank}" if fill else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("root")
    ap.add_argument("reports")
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--index", default="auto")
    ap.add_argument("--files", default="per-rank")
    ap.add_argument("--fanout", type=int, default=1024)
    ap.add_argument("--per-node", type=int, default=0,
                    help="simulate nodes of this many ranks ($MPICKPT_NODE)")
    args = ap.parse_args()
    comm = World()
    rank, world = comm.rank, comm.size
    if args.per_node:
        os.environ["MPICKPT_NODE"] = f"n{rank // args.per_node}"
    files = mpickpt.Files(per=args.files.removeprefix("per-"), fanout=args.fanout,
                          index=args.index, checksum_block=args.block, alignment=4096)
    ck = mpickpt.Checkpointer(args.root, replicated=("rep",), files=files)
    report: dict = {"rank": rank, "world": world}
    if args.mode == "save":
        state = make_state(rank, world, fill=True)
        result = ck.save(7, state, metadata={"world": world}).wait()
        report["committed"] = result.committed
        report["error"] = result.error
        report["stats"] = {k: result.stats.get(k) for k in ("collectives", "manifest_bytes")}
    else:
        state = make_state(rank, world, fill=False)
        step = ck.restore(state)
        info = ck.restore_info
        assert info is not None
        r0, r1 = row_split(world, ROWS[0])[rank]
        c0, c1 = row_split(world, COLS[1])[world - 1 - rank]
        saved_by = info.world_size or world
        report.update(
            step=step,
            saved_by=saved_by,
            rows=torch.equal(state["rows"].tensor, whole("rows")[r0:r1]),
            cols=torch.equal(state["cols"].tensor, whole("cols")[:, c0:c1]),
            rep=torch.equal(state["rep"], whole("rep")),
            mine=torch.equal(state["mine"], torch.full((4,), float(rank % saved_by))),
            note=state["note"],
            bytes_read=info.bytes_read,
            parts_read=mpickpt.format.entry.parts_read(),
            needed=sum(t.numel() * t.element_size() for t in
                       (state["rows"].tensor, state["cols"].tensor, state["rep"],
                        state["mine"])),
        )
    ck.close()
    write_report(args.reports, f"{args.mode}-rank-{rank}.json", report)


if __name__ == "__main__":
    main()
