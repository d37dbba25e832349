"""What the framework integration tests share: the committed steps of a ROOT, and the final
parameters and report each rank of a scenario wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints (MANIFEST.json present), ascending."""
    return sorted(int(p.name[5:]) for p in root.glob("step-*")
                  if p.name[5:].isdigit() and (p / "MANIFEST.json").is_file())


def finals(out: Path, n: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's final parameters (OUT/rank-R.pt, written by the test's own job)."""
    return [torch.load(out / f"rank-{r}.pt") for r in range(n)]


def report(out: Path, r: int) -> dict:
    """Rank ``r``'s report (OUT/rank-R.json)."""
    return json.loads((out / f"rank-{r}.json").read_text())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same parameters, bit for bit."""
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
