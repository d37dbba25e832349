"""The operator's commands on incremental checkpoints: verify reads what a checkpoint refers to,
mpickpt-restore never moves a step a good checkpoint refers to, --prune keeps it, and an export
of an incremental checkpoint equals that of a full one of the same state.

tests/scenarios/incremental.py (2 ranks) saves every step to 8 with ``incremental=4``: steps 1 and
5 are full; 6, 7 and 8 refer to step 5 (frozen tensors) and step 6 (the per-rank tensor).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from clikit import cli, cli_json
from harness import SCENARIOS, run_mpi

from mpickpt.cli import EXIT_OK
from mpickpt.format.manifest import Manifest, read_bytes

SCENARIO = str(SCENARIOS / "incremental.py")
pytestmark = pytest.mark.guarantee("incremental")


def train(root: Path, incremental: int) -> None:
    done = run_mpi(2, [SCENARIO, "train", str(root), str(root.parent / "reports"), "--steps", "8",
                       "--incremental", str(incremental)], timeout=150)
    assert done.returncode == 0, done.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-incremental") / "root"
    train(root, 4)
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    return shutil.copytree(saved, tmp_path / "root")


def flip(root: Path, step: int, rank: int, tensor: str) -> Path:
    """Flip a byte of ``tensor`` in the shard of ``step`` (its own bytes there)."""
    d = root / f"step-{step:08d}"
    m = Manifest.from_json(read_bytes(str(d)), str(d / "MANIFEST.json"))
    rec = next(t for t in m.ranks[rank].tensors if t.name == tensor)
    assert rec.source is None, rec
    path = d / f"rank-{rank:05d}.h5"
    with open(path, "r+b") as f:
        f.seek(rec.offset + 7)
        b = f.read(1)
        f.seek(rec.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    return path


def present(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())


def test_full_verification_passes_and_reads_the_referred_to_bytes(root: Path):
    code, doc = cli_json("verify", root, "--verify", "full")
    assert code == EXIT_OK, doc
    assert all(c["status"] == "committed" for c in doc["checkpoints"]), doc
    # step 7's checked bytes include those of steps 5 and 6 it refers to
    d = root / "step-00000007"
    m = Manifest.from_json(read_bytes(str(d)), str(d / "MANIFEST.json"))
    everything = sum(t.nbytes for e in m.ranks for t in e.tensors)
    assert everything > 3 * m.total_bytes > 0


def test_damage_in_a_referred_to_block_fails_every_checkpoint_that_needs_it(root: Path):
    """step 5's frozen base weights: steps 5 to 8 fail and are quarantined; 4 is chosen."""
    flip(root, 5, 1, "model/base.weight")
    code, doc = cli_json(root, "--verify", "full", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 4, doc
    moved = sorted(a["step"] for a in doc["actions"] if a["action"] == "quarantine")
    assert moved == [5, 6, 7, 8], doc["actions"]
    assert present(root) == [1, 2, 3, 4]


def test_a_damaged_step_that_good_ones_refer_to_stays_in_place(root: Path):
    """step 5's manifest damaged: step 5 is no checkpoint any more, but steps 6 to 8 verify and
    need its shards, so it is left in place (not quarantined), and said to be."""
    manifest = root / "step-00000005" / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":5', b'"step":6'))
    code, doc = cli_json(root, "--verify", "full", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 8, doc
    assert [a for a in doc["actions"] if a["action"] == "quarantine"] == [], doc["actions"]
    left = {Path(x["path"]).name: x["reason"] for x in doc["left_alone"]}
    assert "step 8 (which verifies) refers to its files" in left["step-00000005"], left
    assert present(root) == list(range(1, 9))
    code, doc = cli_json("verify", root, "--verify", "full")
    status = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert status[5] == "corrupt" and all(status[s] == "committed" for s in (6, 7, 8)), status


def test_prune_keeps_what_the_kept_checkpoints_refer_to(root: Path):
    code, doc = cli_json(root, "--prune", "--keep", "1", restore=True)
    assert code == EXIT_OK, doc
    why = {k["step"]: k["why"] for k in doc["retention"]["kept"]}
    assert why == {8: "newest", 6: "referenced by step 8", 5: "referenced by step 8"}, why
    assert present(root) == [5, 6, 8]
    code, doc = cli_json("verify", root, "--verify", "full")
    assert code == EXIT_OK, doc


def test_export_equals_that_of_a_full_checkpoint(root: Path, tmp_path: Path):
    full = tmp_path / "full" / "root"
    train(full, 0)
    assert Manifest.from_json(read_bytes(str(full / "step-00000008")), "M").references == []
    a, b = tmp_path / "inc.pt", tmp_path / "full.pt"
    assert cli("export", root, a)[0] == EXIT_OK
    assert cli("export", full, b)[0] == EXIT_OK
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sorted(x) == sorted(y) and len(x) >= 8
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.quick
def test_a_rollback_moves_only_newer_checkpoints_and_the_target_still_loads(root: Path):
    """--step 6: 7 and 8 (which refer to 5 and 6) are quarantined; 6, which refers to 5, is
    chosen and verifies in full, and --prune --keep 1 on top keeps 5 for it."""
    code, doc = cli_json(root, "--step", "6", "--prune", "--keep", "1", restore=True)
    assert code == EXIT_OK and doc["chosen"]["step"] == 6, doc
    moved = sorted(a["step"] for a in doc["actions"] if a["reason"].startswith("rolled back"))
    assert moved == [7, 8], doc["actions"]
    assert present(root) == [5, 6]
    code, doc = cli_json("verify", root, "--verify", "full")
    assert code == EXIT_OK and {c["step"] for c in doc["checkpoints"]
                                if c["status"] == "committed"} == {5, 6}, doc
