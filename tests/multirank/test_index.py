"""Per-rank index parts (manifest version 2): each rank writes its own records, the manifest
holds only their sizes and checksums, and a restore on the same number of ranks reads one part
per rank, its own (and those of the ranks that wrote the replicated tensors it needs);
resharding reads the parts of the pieces it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import SCENARIOS, run_mpi

SCENARIO = str(SCENARIOS / "reshard.py")


def job(n: int, mode: str, root: Path, reports: Path) -> dict[int, dict]:
    done = run_mpi(n, [SCENARIO, mode, str(root), str(reports), "--index", "per-rank"],
                   timeout=120)
    assert done.returncode == 0, done.output
    return {r: json.loads((reports / f"{mode}-rank-{r}.json").read_text()) for r in range(n)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index") / "root"
    found = job(4, "save", root, root.parent / "save")
    assert all(r["committed"] for r in found.values()), found
    (root.parent / "save-reports.json").write_text(json.dumps(found))
    return root


@pytest.mark.quick
def test_a_save_is_two_collectives_and_a_summary_per_rank(saved: Path):
    """The vote, which gathers the entries, and the outcome's broadcast (each the sizes, then
    the bytes, non-blocking): 2 collectives on every rank, whatever the ranks hold; rank 0 writes
    a manifest of a short summary per rank, not every rank's records."""
    found = json.loads((saved.parent / "save-reports.json").read_text())
    assert {r["stats"]["collectives"] for r in found.values()} == {2}, found
    size = found["0"]["stats"]["manifest_bytes"]
    assert size == (saved / "step-00000007" / "MANIFEST.json").stat().st_size
    parts = sum(p.stat().st_size for p in (saved / "step-00000007" / "index").iterdir())
    assert size < 1200 < parts, (size, parts)  # under 300 bytes per rank


def test_the_manifest_holds_summaries_and_each_rank_its_part(saved: Path):
    step = saved / "step-00000007"
    m = json.loads((step / "MANIFEST.json").read_text())
    assert m["version"] == 2
    for r, entry in enumerate(m["ranks"]):
        assert set(entry) == {"rank", "file", "bytes", "index"}
        part = step / entry["index"]["file"]
        assert part.stat().st_size == entry["index"]["bytes"]
        assert json.loads(part.read_text())["rank"] == r


def test_a_restore_on_as_many_ranks_reads_its_own_part_and_the_replicated_tensors(
        saved: Path, tmp_path: Path):
    """Its sharded pieces and per-rank tensors are in its own part; ``rep`` (replicated, written
    once) is in its writer's: one part for the writer, two for the others, never all four."""
    found = job(4, "restore", saved, tmp_path)
    for r in found.values():
        assert r["step"] == 7 and r["rows"] and r["cols"] and r["rep"] and r["mine"], r
    assert sorted(r["parts_read"] for r in found.values()) == [1, 2, 2, 2], found


@pytest.mark.parametrize("n", [1, 3])
def test_a_restore_on_other_ranks_reads_the_parts_it_needs(saved: Path, tmp_path: Path, n: int):
    found = job(n, "restore", saved, tmp_path)
    for r in found.values():
        assert r["step"] == 7 and r["rows"] and r["cols"] and r["rep"] and r["mine"], r
        assert 1 <= r["parts_read"] <= 4, r
