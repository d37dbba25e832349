"""DDP (gloo on CPU) under mpickpt.run with ``Checkpointer(replicated=("model", "optim"))``:
the state every rank holds alike is written once, spread over the ranks, and a checkpoint of 4
ranks restores on 2 with the same parameters and optimizer state and the same training.

One 4-rank job trains 8 steps, saving at step 4 (tests/scenarios/ddp_train.py, which takes the
state from ``get_state_dict`` as a user of any wrapped model would) and writing the full tensors
there as the reference; its losses of steps 5-8 are the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import manifest
from test_fsdp import SAVE_AT, STEPS, WORLD, full_nbytes, losses, scenario, trained


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The 4-rank DDP run: (checkpoint root, output directory)."""
    return trained("ddp_train.py", tmp_path_factory)


def test_ddp_state_is_written_once_spread_over_the_ranks(saved):
    root, out = saved
    full = full_nbytes(torch.load(out / "reference.pt", weights_only=True))
    m = manifest(root, SAVE_AT)
    assert m["world_size"] == WORLD
    names = [r["name"] for e in m["ranks"] for r in e["tensors"]]
    assert sorted(names) == sorted(full), "each tensor must be written by exactly one rank"
    by_rank = [sum(r["nbytes"] for r in e["tensors"]) for e in m["ranks"]]
    # 1x the model and optimizer tensors, not WORLD x
    assert sum(by_rank) == sum(full.values())
    assert all(0 < b <= sum(full.values()) / 2 for b in by_rank), by_rank


def test_ddp_restores_on_two_ranks(saved):
    root, out = saved
    scenario("ddp_train.py", 2, "resume", root, out)
    got = json.loads((out / "restored-2.json").read_text())
    assert (got["restored"], got["step"], got["saved_by"]) == (SAVE_AT, SAVE_AT, WORLD)
    ref = torch.load(out / "reference.pt", weights_only=True)
    assert set(got["same"]) == {f"model/{k}" for k in ref["model"]} | {
        f"optim/{k}/{s}" for k, st in ref["optim"].items() for s in st}
    differ = [k for k, same in got["same"].items() if not same]
    assert not differ, f"restored on 2 ranks, these differ from the saved tensors: {differ}"
    # every rank needs the whole state: it reads every record once, from whichever rank wrote it
    total = sum(r["nbytes"] for e in manifest(root, SAVE_AT)["ranks"] for r in e["tensors"])
    read = [json.loads((out / f"bytes-2-rank-{r}.json").read_text())["bytes_read"]
            for r in range(2)]
    assert read == [total, total]

    whole, resumed = losses(out, "train"), losses(out, "resume-2")
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx(
        [whole[s] for s in sorted(resumed)], rel=1e-5)
