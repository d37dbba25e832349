"""mpickpt.dcp, DCP's function API, as a torchtitan-style loop calls it (under mpiexec or
torchrun): ``dcp_api.py FOLDER REPORTS``.

Each rank: async_save of steps 10 and 20 (each into its own checkpoint_id, waiting for the
previous future first, as DCP asks), save of step 30, a second save into step 30's id (replaces
it), a save whose write fails on rank 1 (its future raises; the id's previous checkpoint stays),
loads into fresh objects, a load of an id that holds nothing, a state that only pickle could
store, and DCP's storage_writer=. Writes REPORTS/rank-R.json with what came of each.

Run by tests/multirank/test_dcp.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from _report import write_report
from _world import World

import mpickpt.dcp as dcp
from mpickpt import faults


class TrainState:
    """torchtitan's TrainState: a Stateful of plain values."""

    def __init__(self, step: int = 0) -> None:
        self.step, self.losses = step, [0.5 * step]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.losses = sd["step"], list(sd["losses"])


def make(rank: int, step: int) -> dict[str, Any]:
    torch.manual_seed(1000 * rank + step)
    model = torch.nn.Linear(16, 8)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    return {"model": model, "optimizer": optim, "train_state": TrainState(step),
            "dataloader": {"rank": rank, "pos": bytes([rank, step])}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ma, mb = a["model"].state_dict(), b["model"].state_dict()
    oa, ob = a["optimizer"].state_dict()["state"], b["optimizer"].state_dict()["state"]
    return (all(torch.equal(ma[k], mb[k]) for k in ma)
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
            and a["train_state"].state_dict() == b["train_state"].state_dict()
            and a["dataloader"] == b["dataloader"])


def main() -> None:
    folder, reports = sys.argv[1], sys.argv[2]
    world = World()
    rank = world.rank
    out: dict[str, Any] = {"rank": rank}
    future = None
    for step in (10, 20):
        if future is not None:
            future.result()
        future = dcp.async_save(make(rank, step), checkpoint_id=f"{folder}/step-{step}")
    out["async"] = future.result().committed
    out["save"] = dcp.save(make(rank, 30), checkpoint_id=f"{folder}/step-30").committed
    out["again"] = dcp.save(make(rank, 31), checkpoint_id=f"{folder}/step-30").committed
    out["listing"] = sorted(os.listdir(f"{folder}/step-30"))
    faults.configure("mid-write:1:raise")
    try:
        dcp.save(make(rank, 99), checkpoint_id=f"{folder}/step-30")
        out["failed"] = "no error"
    except Exception as e:
        out["failed"] = f"{type(e).__name__}: {e}"
    faults.configure("")
    for step, saved in ((10, 10), (20, 20), (30, 31)):
        fresh = make(rank, 0)
        dcp.load(fresh, checkpoint_id=f"{folder}/step-{step}")
        out[f"load-{step}"] = same(fresh, make(rank, saved))
    for name, call in (
            ("missing", lambda: dcp.load(make(rank, 0), checkpoint_id=f"{folder}/none")),
            ("pickle", lambda: dcp.save({"fn": lambda: 0}, checkpoint_id=f"{folder}/bad")),
            ("writer", lambda: dcp.save(make(rank, 0), checkpoint_id=f"{folder}/w",
                                        storage_writer=object()))):
        try:
            call()
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    dcp.close()
    world.barrier()
    write_report(reports, f"rank-{rank}.json", out)


if __name__ == "__main__":
    main()
