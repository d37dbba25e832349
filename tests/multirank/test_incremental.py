"""Incremental checkpoints on real MPI ranks: what is written, what is referred to, what a restore
reads, on as many and on other numbers of ranks, with retention and index parts.

The job (tests/scenarios/incremental.py) is LoRA-like: frozen base weights and a frozen sharded
table, small tensors that change every step, a sharded bf16 table that changes every step and a
per-rank tensor that changes every 3rd step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import SCENARIOS, run_mpi

from mpickpt.format.manifest import Manifest, read_bytes

SCENARIO = str(SCENARIOS / "incremental.py")
pytestmark = pytest.mark.guarantee("incremental")


def job(n: int, mode: str, root: Path, reports: Path, *extra: str, env: dict | None = None,
        ok: bool = True) -> dict[int, dict]:
    done = run_mpi(n, [SCENARIO, mode, str(root), str(reports), *extra], env=env, timeout=150)
    if ok:
        assert done.returncode == 0, done.output
    return {r: json.loads(p.read_text()) for r in range(n)
            if (p := reports / f"{mode}-rank-{r}.json").exists()}


def manifest(root: Path, step: int) -> Manifest:
    d = root / f"step-{step:08d}"
    return Manifest.from_json(read_bytes(str(d)), str(d / "MANIFEST.json"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    root = tmp_path_factory.mktemp("incremental") / "root"
    found = job(2, "train", root, root.parent / "train", "--steps", "9", "--incremental", "4")
    return root, found


@pytest.mark.quick
def test_unchanged_tensors_are_referred_to_not_written(trained):
    """Saves 1, 5 and 9 are full (every 4th); the others write only what changed, and every
    record they do not write refers to the shard its bytes were written to (no chains)."""
    root, found = trained
    for r in found.values():
        assert r["final"] and r["restored"] is None, r
        full = [s["step"] for s in r["saves"] if s["reused_bytes"] == 0]
        assert full == [1, 5, 9], r["saves"]
        for s in r["saves"]:
            if s["step"] not in full:  # the frozen base, the frozen table: hashed, then reused
                assert s["reused_bytes"] >= 96 * 256 * 4 and s["hashed_bytes"] > 0, s
    sizes = {s: manifest(root, s).total_bytes for s in range(1, 10)}
    for s in (2, 3, 4, 6, 7, 8):
        assert sizes[s] < sizes[1] / 3, sizes
    m = manifest(root, 7)
    assert m.version == 3 and m.references == [5, 6], m.references
    for e in m.ranks:
        by_source = {t.name: t.source for t in e.tensors}
        assert by_source["model/base.weight"] == f"step-00000005/rank-{e.rank:05d}.h5"
        assert by_source["model/lora.A"] is None  # changed: in its own shard
        assert by_source["mine"] == f"step-00000006/rank-{e.rank:05d}.h5"  # changed at 6
        assert set(e.sources) == {f"step-0000000{s}/rank-{e.rank:05d}.h5" for s in (5, 6)}
        assert all((root / f).stat().st_size == size for f, size in e.sources.items())


@pytest.mark.parametrize("n", [2, 1, 3])
def test_a_restore_reads_each_referenced_piece_once(trained, tmp_path: Path, n: int):
    """On as many ranks and resharded onto 1 and 3: every tensor is what step 8 held (the
    newest incremental), read from the shards of steps 5 and 8."""
    root, _ = trained
    found = job(n, "check", root, tmp_path, "--step", "8")
    for r in found.values():
        assert r["restored"] == 8 and all(r["matches"].values()), r
    if n == 2:  # each rank reads exactly its own state's bytes, whichever files they lie in
        own = sum(t.nbytes for t in manifest(root, 8).ranks[0].tensors)
        assert found[0]["bytes_read"] == own, (found[0]["bytes_read"], own)


def test_declared_frozen_tensors_are_not_hashed(tmp_path: Path):
    root = tmp_path / "root"
    found = job(2, "train", root, tmp_path / "r", "--steps", "3", "--incremental", "4",
                "--frozen")
    plain = job(2, "train", tmp_path / "root2", tmp_path / "r2", "--steps", "3",
                "--incremental", "4")
    for r, p in zip(found.values(), plain.values(), strict=True):
        assert r["final"], r
        for a, b in zip(r["saves"][1:], p["saves"][1:], strict=True):
            assert a["reused_bytes"] == b["reused_bytes"] > 0, (a, b)
            assert a["hashed_bytes"] < b["hashed_bytes"] - 96 * 256 * 4, (a, b)
    found = job(2, "check", root, tmp_path / "c")
    assert all(r["restored"] == 3 and all(r["matches"].values()) for r in found.values())


def test_index_parts_carry_the_references(tmp_path: Path):
    """Version 3 with per-rank index parts: the summary lists the steps each rank refers to."""
    root = tmp_path / "root"
    job(2, "train", root, tmp_path / "r", "--steps", "4", "--index", "per-rank")
    raw = json.loads((root / "step-00000004" / "MANIFEST.json").read_text())
    # the frozen tensors lie in step 1's shards, mine (changed at 3) in step 3's
    assert raw["version"] == 3 and raw["references"] == [1, 3], raw["references"]
    assert all(e["references"] == [1, 3] and "tensors" not in e for e in raw["ranks"])
    found = job(3, "check", root, tmp_path / "c")
    assert all(r["restored"] == 4 and all(r["matches"].values()) for r in found.values())


def test_retention_keeps_what_kept_checkpoints_refer_to(tmp_path: Path):
    """keep=2: besides the newest two, the full step and the steps they refer to stay; every
    kept checkpoint loads."""
    root = tmp_path / "root"
    job(2, "train", root, tmp_path / "r", "--steps", "8", "--incremental", "4", "--keep", "2")
    kept = sorted(int(p.name[5:]) for p in root.glob("step-*"))
    # 7 and 8 refer to 5 (full) and 6 (where mine changed last)
    assert kept == [5, 6, 7, 8], kept
    for s in kept:
        found = job(2, "check", root, tmp_path / f"c{s}", "--step", str(s))
        assert all(r["restored"] == s and all(r["matches"].values()) for r in found.values())


@pytest.mark.guarantee("reshard-bit-exact")
def test_compressed_incremental_checkpoints_reshard_bit_for_bit(tmp_path: Path):
    """zstd+shuffle on every tensor of 64 KiB or more (the frozen table, the base weights):
    referred to while compressed, and restored on 3 ranks and on 1, each piece decompressed."""
    root = tmp_path / "root"
    found = job(2, "train", root, tmp_path / "r", "--steps", "3", "--compress", "zstd+shuffle")
    assert all(r["final"] for r in found.values())
    m = manifest(root, 3)
    recs = {t.name: t for t in m.ranks[0].tensors}
    assert recs["model/base.weight"].codec == "zstd+shuffle"
    assert recs["model/base.weight"].source == "step-00000001/rank-00000.h5"
    for n in (3, 1):
        found = job(n, "check", root, tmp_path / f"c{n}")
        assert all(r["restored"] == 3 and all(r["matches"].values()) for r in found.values())
