"""One file per node under a kill: 4 ranks as 2 simulated nodes, one rank SIGKILLed while
writing its regions of its node's file; the last commit stays loadable, the resumed job ends as
an uninterrupted one, and no directory holds more than ``fanout`` shards or index parts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from faultkit import committed_steps, partials
from harness import SCENARIOS, assert_same_final, run_mpi, starts, train

AS_NODES = str(SCENARIOS / "fault_node_files.py")


def data_files(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*.h5"))


@pytest.mark.slow
@pytest.mark.guarantee("no-torn-load", "resume-bit-identical")
@pytest.mark.quick
def test_a_rank_killed_mid_write_of_a_node_file_resumes_from_the_last_commit(tmp_path: Path):
    """4 ranks as 2 nodes, one file per node, one shard or index part per directory: rank 3
    killed while writing its regions of step 10; the resumed job ends as an uninterrupted one."""
    root, out, ref = tmp_path / "ckpt", tmp_path / "out", tmp_path / "ref"
    opts = ["--files", "per-node", "--fanout", "1", "--index", "per-rank"]
    clean = train(4, tmp_path / "unused", 10, ref, extra=["--no-checkpoint"])
    assert clean.returncode == 0, clean.output
    args = [AS_NODES, "2", "--root", str(root), "--steps", "10", "--every", "5", "--keep", "3",
            "--width", "64", *opts]
    dead = run_mpi(4, args, env={"MPICKPT_FAULT": "mid-write:3:kill:10"})
    assert dead.returncode != 0, f"the job survived a SIGKILL of one rank\n{dead.output}"
    assert committed_steps(root) == [5], dead.output
    assert len(partials(root, 10)) == 1
    d = root / "step-00000005"
    assert data_files(d) == ["shards-0000/node-00000.h5", "shards-0001/node-00001.h5"]
    assert sorted(str(p.relative_to(d)) for p in (d / "index").rglob("*.json")) == [
        f"index/part-{n:04d}/node-{n:05d}.json" for n in range(2)]  # one index part per node
    for top, _dirs, files in os.walk(d):  # fanout=1: one shard or part per directory
        assert len([f for f in files if f != "MANIFEST.json"]) <= 1, (top, files)

    resumed = run_mpi(4, [*args, "--out", str(out)])
    assert resumed.returncode == 0, resumed.output
    assert starts(out, 4) == [5] * 4, resumed.output
    assert committed_steps(root) == [5, 10]
    assert_same_final(out, ref, 4)


