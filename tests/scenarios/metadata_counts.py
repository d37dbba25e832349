"""What the metadata of a save and a restore reads, counted: rank 0's commit, and each rank's
restore, with index parts (as above 64 ranks).

Usage: metadata_counts.py ROOT REPORTS replicated|sharded per-rank|per-node [restore]

The state holds 3 x N small tensors under "model" (N ranks), every rank holding each whole
(``replicated``: DDP, ``Checkpointer(replicated=("model",))``, spread over every rank by
``Files(min_write_share=0)`` so that each rank writes about three of them) or its own rows
of each (``sharded``: FSDP, ``Piece``), and a per-rank tensor
"mine". Steps 1, 2 and 3 are saved (keep=2: the third save's retention deletes step 1), each
waited for; rank 0 counts the index parts and metadata bytes it read during each. Then every
rank restores into a zeroed state and counts the same (``restore``: only that). ``per-node``:
nodes of two ranks ($MPICKPT_NODE), one file and one index part per node. Each rank writes
REPORTS/rank-R.json, with what the restore skipped and why.

Run by tests/multirank/test_metadata_counts.py.
"""

from __future__ import annotations

import os
import sys

import torch
from _report import write_report
from mpi4py import MPI

import mpickpt
from mpickpt.format import entry

ROWS = 4


def state(layout: str, rank: int, world: int, step: int) -> dict:
    """Step ``step``'s state (zeros for step 0), a function of (rank, step) alone."""
    model = {}
    for i in range(3 * world):
        if layout == "replicated":
            model[f"w{i}"] = torch.full((64 + i,), float(step * 1000 + i))
        else:
            rows = torch.full((ROWS, 8), float(step * 1000 + i * 10 + rank))
            model[f"w{i}"] = mpickpt.Piece(rows, (ROWS * world, 8), (ROWS * rank, 0))
    return {"model": model, "mine": torch.full((5,), float(step * 100 + rank))}


def counted() -> tuple[int, int]:
    return entry.parts_read(), entry.metadata_bytes_read()


def main() -> None:
    root, reports, layout, files = sys.argv[1:5]
    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    if files == "per-node":
        os.environ["MPICKPT_NODE"] = f"n{rank // 2}"
    ck = mpickpt.Checkpointer(root, keep=2, replicated=("model",) if layout == "replicated"
                              else (), files=mpickpt.Files(per=files.removeprefix("per-"),
                                                           index="per-rank", min_write_share=0))
    report: dict = {"rank": rank, "commits": []}
    for step in () if sys.argv[5:] == ["restore"] else (1, 2, 3):
        before = counted()
        result = ck.save(step, state(layout, rank, world, step)).wait()
        parts, nbytes = (a - b for a, b in zip(counted(), before, strict=True))
        report["commits"].append({"step": step, "committed": result.committed, "parts": parts,
                                  "bytes": nbytes})
    live = state(layout, rank, world, 0)
    before = counted()
    report["restored"] = ck.restore(live)
    report["restore_parts"], report["restore_bytes"] = (
        a - b for a, b in zip(counted(), before, strict=True))
    assert ck.restore_info is not None
    report["skipped"] = [list(x) for x in ck.restore_info.skipped]
    want = state(layout, rank, world, report["restored"])
    report["correct"] = torch.equal(live["mine"], want["mine"]) and all(
        torch.equal(getattr(live["model"][k], "tensor", live["model"][k]),
                    getattr(want["model"][k], "tensor", want["model"][k]))
        for k in want["model"])
    ck.close()
    write_report(reports, f"rank-{rank}.json", report)


if __name__ == "__main__":
    main()
