"""Restore examples/train.py's state from many ROOTs in one job, and report what each restore did.

Usage: fault_hostile_restore.py PLAN.json [--limit-as-mb MB]

PLAN.json: {"width": W, "cases": [{"name": NAME, "root": ROOT, "reports": DIR, "step": S|null}]}.
For each case every rank builds a fresh state, restores ROOT into it (``step`` given: that one
only) and writes DIR/rank-R.json: the restored step (null when none), restore_info.skipped, the
error restore raised (if any), whether the state is still bit-identical to its initial values
("untouched"), what the state holds afterwards ("arrays": name -> [dtype, shape, xxh3-64 of the
bytes], "tree": the state tree, both as mpickpt.format.state_tree.flatten names them, so that a
test can compare them with what h5py reads from a shard), and by how much the rank's peak resident
memory grew during the case.

``--limit-as-mb MB``: after start-up the address space of every rank is limited to what it uses
plus MB, so an allocation sized by a lying manifest fails instead of passing unnoticed.

Run by tests/faults/test_fault_hostile.py (its test_restore cases).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import xxhash
from mpi4py import MPI

import mpickpt
from mpickpt.format import state_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from _report import write_report
from fault_restore import image
from train import make_state


def vm_size() -> int:
    """This process's address space in bytes (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def contents(state: dict) -> tuple[dict, dict]:
    """(arrays, tree) of ``state`` as the checkpoint stores them."""
    tree, arrays = state_tree.flatten(state)
    out = {}
    for name, t in arrays.items():
        flat = t.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape),
                     xxhash.xxh3_64_hexdigest(data)]
    return out, tree


def run_case(case: dict, width: int, rank: int) -> dict:
    state = make_state(rank, width)
    before = image(state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ck = mpickpt.Checkpointer(case["root"])
    step, error = None, None
    try:
        step = ck.restore(state, step=case.get("step"))
    except mpickpt.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    info = ck.restore_info
    ck.close()
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    arrays, tree = contents(state)
    return {
        "rank": rank, "step": step, "error": error,
        "skipped": [list(s) for s in info.skipped] if info is not None else None,
        "untouched": image(state) == before, "arrays": arrays, "tree": tree,
        "maxrss_grew_kb": grew,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--limit-as-mb", type=int)
    args = ap.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    rank = MPI.COMM_WORLD.rank
    if args.limit_as_mb:
        limit = vm_size() + (args.limit_as_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for case in plan["cases"]:
        report = run_case(case, plan["width"], rank)
        write_report(case["reports"], f"rank-{rank}.json", report)


if __name__ == "__main__":
    main()
