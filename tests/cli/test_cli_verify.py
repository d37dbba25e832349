"""mpickpt ls / verify (and mpickpt-restore --list): read-only, exit codes, the same verdict in
parallel under mpiexec -n 4 as in one process."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from clikit import (
    PARTIAL,
    by_step,
    cli,
    cli_json,
    copy_tree,
    garble_manifest,
    listing,
    partial_dirs,
    pristine,
)
from harness import flip_data_byte, manifest, run_mpi, shard, step_dir

from mpickpt.cli import EXIT_DAMAGED, EXIT_NO_CHECKPOINT, EXIT_OK


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ls_lists_every_checkpoint_and_changes_nothing(tmp_path_factory, n):
    root = pristine(n, tmp_path_factory)
    before = listing(root)
    code, doc = cli_json("ls", root)
    assert code == EXIT_OK and doc["command"] == "list" and doc["current"] == 20
    rows = by_step(doc)
    assert set(rows) == {(20, "committed"), (15, "committed"), (10, "committed"),
                         (PARTIAL, "partial")}
    assert [c["step"] for c in doc["checkpoints"] if c["current"]] == [20]
    for s in (20, 15, 10):
        c = rows[(s, "committed")]
        assert c["world_size"] == n and c["verified"] == "quick" and c["problems"] == []
        assert c["bytes"] == sum(shard(root, s, r).stat().st_size for r in range(n))
        assert c["time_iso"].endswith("Z")
    assert rows[(PARTIAL, "partial")]["path"] == str(partial_dirs(root)[0])
    # the same through mpickpt-restore --list, and the table for people
    again = cli_json(root, "--list", restore=True)[1]["checkpoints"]
    assert [{**c, "age_s": 0} for c in again] == [{**c, "age_s": 0} for c in doc["checkpoints"]]
    code, out, _ = cli("ls", root)
    assert code == EXIT_OK
    assert "STEP" in out and "STATUS" in out and "partial" in out
    assert "* = the checkpoint Checkpointer.restore() will load: step 20" in out
    assert listing(root) == before


@pytest.mark.parametrize("n", [1, 2, 4])
def test_verify_full_reads_every_checksum(tmp_path, tmp_path_factory, n):
    root = copy_tree(n, tmp_path_factory, tmp_path / "ckpt")
    code, doc = cli_json("verify", root)
    assert code == EXIT_OK and doc["verify"] == "full"
    assert all(c["verified"] == "full" for c in doc["checkpoints"] if c["status"] == "committed")
    assert doc["checked_bytes"] == sum(t["nbytes"] for s in (10, 15, 20)
                                       for r in manifest(root, s)["ranks"] for t in r["tensors"])
    path, tensor = flip_data_byte(root, 15, rank=n - 1)
    code, doc = cli_json("verify", root)
    assert code == EXIT_DAMAGED and doc["current"] == 20
    p = by_step(doc)[(15, "corrupt")]["problems"][0]
    assert (p["rank"], p["file"]) == (n - 1, str(path))
    assert f"rank {n - 1}: {path}: tensor '{tensor}': checksum mismatch in block 0" in p["reason"]
    code, out, _ = cli("verify", root)
    assert "corrupt" in out and "mpickpt-restore" in out and "quarantine" in out
    # one checkpoint by its path
    code, doc = cli_json("verify", step_dir(root, 15))
    assert code == EXIT_DAMAGED and doc["checkpoints"][0]["status"] == "corrupt"
    assert cli_json("verify", step_dir(root, 20))[0] == EXIT_OK


@pytest.mark.quick
def test_every_kind_of_damage_is_named(tmp_path, tmp_path_factory):
    root = copy_tree(4, tmp_path_factory, tmp_path / "ckpt")
    os.truncate(shard(root, 20, 3), 1000)
    shard(root, 15, 2).unlink()
    garble_manifest(root, 10)
    code, doc = cli_json("ls", root)
    assert code == EXIT_NO_CHECKPOINT and doc["current"] is None
    rows = by_step(doc)
    assert "size is 1000 bytes" in rows[(20, "corrupt")]["problems"][0]["reason"]
    assert rows[(15, "corrupt")]["problems"][0]["rank"] == 2
    assert "not valid JSON" in rows[(10, "corrupt")]["problems"][0]["reason"]
    code, out, _ = cli("ls", root)
    assert "no checkpoint passes verification" in out


def test_ls_says_what_the_pool_of_retired_shards_holds(tmp_path, tmp_path_factory):
    root = copy_tree(2, tmp_path_factory, tmp_path / "ckpt")
    shutil.rmtree(root / ".pool", ignore_errors=True)
    code, doc = cli_json("ls", root)
    assert code == EXIT_OK and doc["pool"] == {"files": 0, "bytes": 0}
    assert ".pool/" not in cli("ls", root)[1]
    (root / ".pool" / "00").mkdir(parents=True)
    for name, mib in (("rank-00000.h5", 3), ("00/rank-00001.h5", 1)):
        (root / ".pool" / name).write_bytes(os.urandom(mib << 20))
    code, doc = cli_json("ls", root)
    assert code == EXIT_OK and doc["pool"]["files"] == 2
    assert 4 << 20 <= doc["pool"]["bytes"] < (4 << 20) + (64 << 10)
    out = cli("ls", root)[1]
    assert ".pool/: 2 shard file(s) of a retired checkpoint, 4.2 MB, which the job's next save " \
        "writes over" in out, out
    assert f"rm -r {root / '.pool'}" in " ".join(out.split()), out


def test_empty_root(tmp_path):
    code, doc = cli_json("ls", tmp_path)
    assert code == EXIT_NO_CHECKPOINT and doc["checkpoints"] == []
    code, out, _ = cli("verify", tmp_path)
    assert code == EXIT_NO_CHECKPOINT and "no checkpoints" in out


def _verdicts(doc: dict) -> list:
    return [(c["step"], c["status"], c["verified"], c["current"], c["problems"])
            for c in doc["checkpoints"]]


def test_parallel_verify_under_mpiexec_gives_the_same_verdict(tmp_path, tmp_path_factory):
    root = copy_tree(4, tmp_path_factory, tmp_path / "ckpt")
    flip_data_byte(root, 20, rank=3)
    flip_data_byte(root, 20, rank=1)
    os.truncate(shard(root, 10, 2), 5000)
    code, single = cli_json("verify", root, "--verify", "full")
    assert code == EXIT_DAMAGED
    job = run_mpi(4, ["-m", "mpickpt.cli.main", "verify", str(root), "--verify", "full",
                      "--json"], timeout=120)
    assert job.returncode == EXIT_DAMAGED, job.output
    parallel = json.loads(job.stdout)  # only rank 0 prints
    assert _verdicts(parallel) == _verdicts(single)
    assert parallel["checked_bytes"] == single["checked_bytes"]
    problems = by_step(parallel)[(20, "corrupt")]["problems"]
    assert [p["rank"] for p in problems] == [1, 3]
