"""The fault matrix's job: a synthetic state that is a pure function of (rank, step), saved and
restored with one fault injected; and the verification of many checkpoint roots in one launch.

Usage (under ``python -m mpickpt.run``): ``fault_matrix.py fault PLAN.json`` or
``fault_matrix.py verify PLAN.json``.

fault: PLAN is ``{"timeout": S, "cases": [{"dir": D, "phase": P, "rank": R, "action": A}, ...]}``;
the cases run one after the other, each with its own root ``D/ckpt`` and a Checkpointer (keep=2,
collective deadline S). A save-path case saves steps 10, 20 and 30 with the fault armed for step
30; a ``mid-restore-read`` case saves 10 and 20, then restores with the fault armed for step 20.
Then the job restores into a fresh state (a job whose fault did not end it goes on working) and
every rank writes ``D/job/rank-R.json``: each save's result (or what it raised), the restore's
step, skipped checkpoints, error, and which step each value of the restored state equals.

verify: PLAN is ``{"roots": [D, ...]}``; for each, a fresh Checkpointer restores the newest
checkpoint under ``D/ckpt`` into a fresh state, then every committed step on disk explicitly, and
every rank writes ``D/verify/rank-R.json`` with the same analysis.

Run by tests/matrix/test_fault_matrix.py and tests/matrix/test_fault_matrix_torchrun.py (through
matrix_kit.py), under mpiexec or torchrun.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from _report import write_report
from _world import World

import mpickpt
from mpickpt import faults
from mpickpt.format import names, rootdir

SAVES = (10, 20, 30)
FAULT_STEP = 30          # the save-path phases fire in the save of this step
RESTORE_FAULT_STEP = 20  # mid-restore-read fires while reading this step
FRESH = 0                # the step whose values a fresh state holds (never saved)
CANDIDATES = (FRESH, *SAVES)


def make_state(rank: int, step: int) -> dict[str, Any]:
    """The state of ``rank`` at ``step``: every value differs between steps and between ranks."""
    seed = 1_000_003 * (rank + 1) + step
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "weight": torch.randn(256, 1024, generator=g),                  # 1 MiB float32
            "bias": torch.randn(1000, generator=g).to(torch.bfloat16),
            "index": torch.randint(-2**62, 2**62, (333,), generator=g, dtype=torch.int64),
            "scale": torch.tensor(rank * 1000.0 + step + 0.25, dtype=torch.float64),  # 0-d
            "mask": torch.rand(7, 9, generator=g) > 0.5,
        },
        "optim": {
            "moments": [torch.randn(64, 3, generator=g, dtype=torch.float16),
                        torch.randn(5, generator=g).to(torch.complex64)],
            "hyper": {"lr": 0.1 / (step + 1) + rank, "beta": (0.9, step),
                      "nesterov": step % 20 == 0},
        },
        "data": rng.standard_normal((13, 11)),                               # float64 ndarray
        "counts": rng.integers(0, 2**31, 17, dtype=np.int32),
        "np_scalar": np.float32(step + rank / 8),
        "meta": {
            "step": step, "rank": rank, "name": f"rank{rank}-step{step}", "tag": None,
            "specials": [math.inf if step % 20 else -math.inf, -0.0 if step else 0.0,
                         step * 1e-300],
            "nested": {"deep": {"epoch": step // 10, "seen": b"%d/%d" % (rank, step)}},
        },
    }


def leaves(x: Any, path: str = "") -> dict[str, tuple]:
    """Every leaf of a state by key path, as an exact comparable image (type, dtype, shape,
    bytes; python values by type and repr)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous().reshape(-1)
        return {path: ("tensor", str(x.dtype), tuple(x.shape),
                       t.view(torch.uint8).numpy().tobytes())}
    if isinstance(x, np.ndarray):
        return {path: ("ndarray", str(x.dtype), x.shape, x.tobytes())}
    if isinstance(x, np.generic):
        return {path: ("npscalar", str(x.dtype), x.tobytes())}
    if isinstance(x, dict):
        out: dict[str, tuple] = {}
        for k, v in x.items():
            out.update(leaves(v, f"{path}/{k}"))
        return out
    if isinstance(x, (list, tuple)):
        out = {}
        for i, v in enumerate(x):
            out.update(leaves(v, f"{path}/{type(x).__name__}[{i}]"))
        return out
    return {path: ("value", type(x).__name__, repr(x))}


def analyse(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Which candidate steps each leaf of ``state`` equals bit for bit: ``steps`` (the steps
    every leaf equals), ``foreign`` (leaves equal to no step's value, or missing), ``mixed``
    (when no one step has all the other leaves, a torn state: the steps they come from)."""
    mine = leaves(state)
    refs = {s: leaves(make_state(rank, s)) for s in CANDIDATES}
    per_leaf = {p: {s for s in CANDIDATES if refs[s].get(p) == v} for p, v in mine.items()}
    known = [steps for steps in per_leaf.values() if steps]
    common = set(CANDIDATES).intersection(*known)
    foreign = sorted(p for p, steps in per_leaf.items() if not steps)
    return {
        "steps": sorted(common) if not foreign else [],
        "foreign": foreign + [p for p in refs[FRESH] if p not in mine],
        "mixed": sorted({min(s) for s in known if len(s) == 1} or set().union(*known))
        if not common else [],
    }


def restore(ck: mpickpt.Checkpointer, rank: int, step: int | None = None) -> dict[str, Any]:
    """Restore into a fresh state; what came of it."""
    state = make_state(rank, FRESH)
    out: dict[str, Any] = {"step": None, "error": None, "skipped": []}
    try:
        out["step"] = ck.restore(state, step=step)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if ck.restore_info is not None:
        out["skipped"] = [list(s) for s in ck.restore_info.skipped]
    return out | analyse(state, rank)


def fault_case(case: dict[str, Any], timeout: float, rank: int) -> dict[str, Any]:
    phase, action = case["phase"], case["action"]
    on_restore = phase == "mid-restore-read"
    spec = f"{phase}:{case['rank']}:{action}:{RESTORE_FAULT_STEP if on_restore else FAULT_STEP}"
    ck = mpickpt.Checkpointer(os.path.join(case["dir"], "ckpt"), keep=2, timeout=timeout)
    faults.configure("" if on_restore else spec)
    saves: dict[int, dict[str, Any]] = {}
    for step in SAVES[:2] if on_restore else SAVES:
        try:
            result = ck.save(step, make_state(rank, step)).wait()
            saves[step] = {k: v for k, v in asdict(result).items() if k != "stats"}
        except Exception as e:
            saves[step] = {"raised": f"{type(e).__name__}: {e}"}
    faults.configure(spec if on_restore else "")
    restored = restore(ck, rank)
    faults.configure("")
    ck.close()
    return {"rank": rank, "spec": spec, "saves": saves, "restore": restored}


def verify_root(where: str, rank: int, world: World) -> dict[str, Any]:
    root = os.path.join(where, "ckpt")
    ck = mpickpt.Checkpointer(root, timeout=60)
    newest = restore(ck, rank)
    world.barrier()
    on_disk = sorted(s for s, _ in rootdir.committed(root))
    each = {s: restore(ck, rank, s) for s in on_disk}
    ck.close()
    world.barrier()
    return {"rank": rank, "newest": newest, "on_disk": on_disk, "each": each,
            "left": leftovers(root)}


def leftovers(root: str) -> list[str]:
    """What ROOT holds besides committed steps, stats.jsonl and the pool of retired rank shards
    (which the next save writes over): a partial or half-removed checkpoint, anything else."""
    pool = os.path.join(root, rootdir.POOL)
    stray = sorted(f"{rootdir.POOL}/{n}" for n in (os.listdir(pool) if os.path.isdir(pool) else [])
                   if not names.RANK_FILE_RE.match(n))
    return sorted(n for n in os.listdir(root) if not rootdir.STEP_RE.match(n)
                  and n not in ("stats.jsonl", rootdir.POOL)) + stray


def main() -> None:
    mode, plan_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    comm = World()
    rank = comm.rank
    comm.barrier()  # ranks that imported torch at different times meet before any deadline runs
    if mode == "fault":
        for case in plan["cases"]:
            report = fault_case(case, float(plan["timeout"]), rank)
            write_report(os.path.join(case["dir"], "job"), f"rank-{rank}.json", report)
            comm.barrier()
    elif mode == "verify":
        for where in plan["roots"]:
            write_report(os.path.join(where, "verify"), f"rank-{rank}.json",
                         verify_root(where, rank, comm))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
