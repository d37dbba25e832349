"""What metadata a save's commit and a restore read, counted on real jobs with index parts (as
above 64 ranks; the tiling check that reads every part at 64 ranks and fewer is off): rank 0's
commit reads no index part, only the manifest it wrote (retention's ranking), and a restoring
rank reads its own part, plus the replicated part when every rank holds tensors (DDP), never
one part per writer of them. Each count, were it to grow with the ranks, fails here.
See tests/scenarios/metadata_counts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import SCENARIOS, run_mpi

SCENARIO = str(SCENARIOS / "metadata_counts.py")
CASES = [(4, "replicated", "per-rank"), (4, "replicated", "per-node"),
         (4, "sharded", "per-rank"), (4, "sharded", "per-node"), (16, "replicated", "per-rank")]


def size(path: Path) -> int:
    return path.stat().st_size


def job(n: int, root: Path, reports: Path, layout: str, files: str, *mode: str
        ) -> dict[int, dict]:
    done = run_mpi(n, [SCENARIO, str(root), str(reports), layout, files, *mode],
                   env={"MPICKPT_CHECK_PIECES_RANKS": "0"}, timeout=240)
    assert done.returncode == 0, done.output
    return {r: json.loads((reports / f"rank-{r}.json").read_text()) for r in range(n)}


@pytest.mark.parametrize(("n", "layout", "files"), [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}",
                 marks=[pytest.mark.quick] if c == (4, "replicated", "per-rank") else [])
    for c in CASES])
def test_the_commit_reads_no_index_part_and_a_restore_one_or_two(
        tmp_path: Path, n: int, layout: str, files: str):
    root = tmp_path / "root"
    found = job(n, root, tmp_path / "reports", layout, files)
    step = root / "step-00000003"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    replicated = step / "index" / "replicated.json"
    assert replicated.exists() == (layout == "replicated"), sorted(step.rglob("*.json"))
    for r, got in found.items():
        assert got["restored"] == 3 and got["correct"], got
        for c in got["commits"]:
            assert c["committed"], got
            # rank 0 reads the manifest it wrote once (retention ranks the checkpoints by it);
            # no rank reads an index part, whatever the number of ranks
            assert c["parts"] == 0, (r, c)
            assert c["bytes"] <= (size(step / "MANIFEST.json") + 16 if r == 0 else 0), (r, c)
        own = step / manifest["ranks"][r]["index"]["file"]
        if layout == "replicated":  # its own part, and every writer's records in one more
            assert got["restore_parts"] == 2, (r, got)
            allowed = size(own) + size(replicated)
        else:
            assert got["restore_parts"] == 1, (r, got)
            allowed = size(own)
        if r == 0:  # rank 0 reads the manifest and broadcasts it
            allowed += size(step / "MANIFEST.json")
        assert got["restore_bytes"] == allowed, (r, got, allowed)


@pytest.mark.guarantee("damage-detected")
def test_a_damaged_replicated_part_falls_back_to_the_previous_checkpoint_naming_it(
        tmp_path: Path):
    root = tmp_path / "root"
    job(4, root, tmp_path / "saved", "replicated", "per-rank")
    part = root / "step-00000003" / "index" / "replicated.json"
    data = part.read_bytes()
    assert b'/w1"' in data
    part.write_bytes(data.replace(b'/w1"', b'/w7"', 1))  # valid JSON, another tensor's name
    found = job(4, root, tmp_path / "restored", "replicated", "per-rank", "restore")
    for got in found.values():
        assert got["restored"] == 2 and got["correct"], got
        assert [s for s, _ in got["skipped"]] == [3], got
        why = got["skipped"][0][1]
        assert str(part) in why and "checksum mismatch" in why, why
