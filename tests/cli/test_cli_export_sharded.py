"""``mpickpt export`` of a sharded checkpoint: the pieces become whole tensors."""

from __future__ import annotations

import sys

import pytest
import torch
from clikit import cli
from harness import SCENARIOS, run_mpi

sys.path.insert(0, str(SCENARIOS))
from reshard import whole  # the scenario's global tensors


@pytest.mark.quick
def test_export_assembles_sharded_and_replicated_pieces(tmp_path):
    root = tmp_path / "ck"
    done = run_mpi(3, [str(SCENARIOS / "reshard.py"), "save", str(root), str(tmp_path / "r")],
                   timeout=120)
    assert done.returncode == 0, done.output
    code, out, err = cli("export", root, tmp_path / "out.pt")
    assert code == 0, out + err
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(got) == ["cols", "rank0/mine", "rank1/mine", "rank2/mine", "rep", "rows"]
    for name in ("rows", "cols", "rep"):
        assert torch.equal(got[name], whole(name)), name
    for r in range(3):
        assert torch.equal(got[f"rank{r}/mine"], torch.full((4,), float(r)))
