"""The node-local level across a lost node, under torchrun:
``torchrun_level.py ROOT LOCAL partner|xor save|restore REPORTS``.

Two ranks per simulated node (``MPICKPT_NODE``). save: steps 1 and 2 committed on the level
(never drained to ROOT). restore: into a fresh state; each rank reports the step, the level it
came from and whether every value is its own of step 2.

Run by tests/multirank/test_torchrun.py.
"""

from __future__ import annotations

import os
import sys

import torch
from _report import write_report
from _world import World

import mpickpt


def main() -> None:
    root, local, scheme, mode, reports = sys.argv[1:6]
    world = World()
    rank = world.rank
    os.environ["MPICKPT_NODE"] = f"n{rank // 2}"
    ck = mpickpt.Checkpointer(root, keep=2, local=mpickpt.Local(local, redundancy=scheme,
                                                                persist_every=None))
    report: dict = {"rank": rank}
    if mode == "save":
        state = {"w": torch.full((1000, 100), float(rank)), "s": 0}
        for step in (1, 2):
            state["w"] += 1
            state["s"] = step
            result = ck.save(step, state).wait()
            report[f"save-{step}"] = [result.committed, result.level]
    else:
        fresh = {"w": torch.zeros(1000, 100), "s": -1}
        report["step"] = ck.restore(fresh)
        report["level"] = ck.restore_info.level if ck.restore_info else None
        report["exact"] = fresh["s"] == 2 and bool((fresh["w"] == rank + 2).all())
    ck.close()
    write_report(reports, f"{mode}-rank-{rank}.json", report)


if __name__ == "__main__":
    main()
