"""One file per node (``files="per-node"``) and sub-directories (``fanout``) on real MPI jobs,
nodes simulated with $MPICKPT_NODE: a checkpoint of 4 ranks on 2 nodes is 2 data files, each
an HDF5 file with a group per rank that h5py reads, and 2 index parts; restore and resharding
read each rank's regions and only the parts they need; incremental saves refer to older node
files (tests/faults/test_fault_node_files.py kills a rank mid-write)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import SCENARIOS, manifest, run_mpi

from mpickpt.cli.main import main as cli

RESHARD = str(SCENARIOS / "reshard.py")


def job(n: int, mode: str, root: Path, reports: Path, *extra: str) -> dict[int, dict]:
    done = run_mpi(n, [RESHARD, mode, str(root), str(reports), "--files", "per-node",
                       "--per-node", "2", *extra], timeout=120)
    assert done.returncode == 0, done.output
    return {r: json.loads((reports / f"{mode}-rank-{r}.json").read_text()) for r in range(n)}


def data_files(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*.h5"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nodefiles") / "root"
    found = job(4, "save", root, root.parent / "save", "--index", "per-rank")
    assert all(r["committed"] for r in found.values()), found
    return root


@pytest.mark.quick
def test_four_ranks_on_two_nodes_write_two_files_that_h5py_reads(saved: Path):
    d = saved / "step-00000007"
    assert data_files(d) == ["node-00000.h5", "node-00001.h5"]
    m = manifest(saved, 7)
    assert m["version"] == 3
    assert [e["file"] for e in m["ranks"]] == ["node-00000.h5"] * 2 + ["node-00001.h5"] * 2
    parts = [f"index/node-0000{n}.json" for n in (0, 0, 1, 1)]  # one index part per node
    assert [e["index"]["file"] for e in m["ranks"]] == parts
    assert sorted(str(p.relative_to(d)) for p in d.rglob("*.json")) == [
        "MANIFEST.json", "index/node-00000.json", "index/node-00001.json",
        "index/replicated.json"]  # the records of "rep", which every rank holds
    assert m["ranks"][0]["bytes"] == m["ranks"][1]["bytes"] == (d / "node-00000.h5").stat().st_size
    with h5py.File(d / "node-00001.h5", "r") as f:
        assert sorted(f) == ["rank-00002", "rank-00003"]
        for r in (2, 3):
            g = f[f"rank-{r:05d}"]
            assert int(g.attrs["rank"]) == r and int(g.attrs["step"]) == 7
            np.testing.assert_array_equal(g["tensors/mine"][()], np.full(4, float(r)))


def test_full_verify_reads_every_rank_of_a_node_file(saved: Path, capsys):
    assert cli(["verify", str(saved)]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("n", [4, 3, 1])
def test_restore_and_resharding_read_each_ranks_regions(saved: Path, tmp_path: Path, n: int):
    found = job(n, "restore", saved, tmp_path)
    for r in found.values():
        assert r["step"] == 7 and r["rows"] and r["cols"] and r["rep"] and r["mine"], r
        assert 1 <= r["parts_read"] <= 2, r  # of the 2 nodes' parts, each read once at most
    if n == 4:  # its own node's part, and rank 0's (the writer of "rep") on the other node
        assert sorted(r["parts_read"] for r in found.values()) == [1, 1, 2, 2], found


def test_the_ranks_of_one_node_file_must_agree_on_its_size(saved: Path, tmp_path: Path):
    """A manifest whose ranks of one node file disagree on its size is refused (they read it
    as one file of one size)."""
    from mpickpt.errors import ManifestError
    from mpickpt.format.manifest import Manifest

    d = json.loads((saved / "step-00000007" / "MANIFEST.json").read_text())
    d["ranks"][1]["bytes"] += 1
    with pytest.raises(ManifestError, match="another rank's entry says"):
        Manifest.from_json(json.dumps(d), str(tmp_path))


def test_per_node_files_are_refused_with_what_they_cannot_serve(tmp_path: Path):
    """files="per-node" with the node-local level or compression, or a bad fanout, is refused
    at once (before MPI is touched), naming what to change."""
    import mpickpt

    for kwargs, match in (
        ({"files": "per-node", "local": str(tmp_path / "l")}, "node-local level"),
        ({"files": "per-node", "compression": "zstd"}, "compressed chunks"),
        ({"files": "per-host"}, "'per-rank' or 'per-node'"),
        ({"files": "per-node", "fanout": 0}, r"Files\(fanout=\) must be a positive int"),
    ):
        with pytest.raises(ValueError, match=match):
            mpickpt.Checkpointer(tmp_path / "root", **kwargs)


@pytest.mark.guarantee("incremental", "reshard-bit-exact")
def test_incremental_checkpoints_refer_to_older_node_files(tmp_path: Path):
    """Incremental saves in node files: unchanged tensors refer to an older step's node file,
    and every committed step restores exactly on 4 ranks and resharded onto 3."""
    root, scenario = tmp_path / "root", str(SCENARIOS / "incremental.py")
    done = run_mpi(4, [scenario, "train", str(root), str(tmp_path / "t"), "--steps", "4",
                       "--per-node", "2", "--index", "per-rank"], timeout=150)
    assert done.returncode == 0, done.output
    m = manifest(root, 4)
    assert m["references"] == [1, 3], m["references"]
    part = json.loads((root / "step-00000004" / "index" / "node-00001.json").read_text())
    srcs = {t["name"]: t.get("source") for t in part["ranks"][1]["tensors"]}
    assert srcs["model/base.weight"] == "step-00000001/node-00001.h5", srcs
    for n in (4, 3):
        done = run_mpi(n, [scenario, "check", str(root), str(tmp_path / f"c{n}"), "--all"],
                       timeout=150)
        assert done.returncode == 0, done.output
        for r in range(n):
            found = json.loads((tmp_path / f"c{n}" / f"check-rank-{r}.json").read_text())
            assert found["all"] == {str(s): True for s in (1, 2, 3, 4)}, found
