"""A ROOT that was not one directory shared by every rank (node-local storage on several nodes).

The library now refuses such a ROOT when the Checkpointer is made, so the trees a user may still
have are forged from a real 2-rank crash tree (clikit): rank 1's shards are moved out of ROOT
into another "node's" copy of the path, where they sit in partial directories, as a job on two
nodes with a node-local ROOT leaves them. Then: under ``mpiexec`` with each rank in its own
working directory (so that the same relative ROOT is a different directory per rank, as on two
nodes), the CLI refuses to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from clikit import COMMITTED, cli, cli_json, copy_tree, listing, partial_dirs
from harness import mpiexec, shard, step_dir

from mpickpt.cli import EXIT_ERROR, EXIT_NO_CHECKPOINT, EXIT_OK
from mpickpt.format import rootdir

HINT = rootdir.not_shared_hint()


def split_over_two_nodes(tmp_path, tmp_path_factory):
    """(rank 0's node's ROOT, rank 1's node's ROOT), forged from a real 2-rank tree."""
    root = copy_tree(2, tmp_path_factory, tmp_path / "node0" / "ckpt")
    other = tmp_path / "node1" / "ckpt"
    other.mkdir(parents=True)
    run = partial_dirs(root)[0].name.split(".partial-")[1]
    for s in COMMITTED:
        dest = other / rootdir.partial_name(s, run)
        dest.mkdir()
        os.rename(shard(root, s, 1), dest / "rank-00001.h5")
    crash = partial_dirs(root)[0]
    (other / crash.name).mkdir()
    os.rename(crash / "rank-00001.h5", other / crash.name / "rank-00001.h5")
    return root, other


@pytest.mark.quick
def test_rank_0s_root_is_called_not_shared(tmp_path, tmp_path_factory):
    root, _ = split_over_two_nodes(tmp_path, tmp_path_factory)
    want = ("shards of rank 1 are missing from every checkpoint (3) while rank 0's are present: "
            f"{HINT}")
    for argv in (["ls", root], ["verify", root], [root, "--list"]):
        code, doc = cli_json(*argv, restore=argv[0] == root)
        assert code == EXIT_NO_CHECKPOINT, doc
        assert doc["not_shared"]["missing_ranks"] == [1]
        assert doc["not_shared"]["present_ranks"] == [0]
        assert doc["not_shared"]["message"].startswith(want), doc["not_shared"]
        code, out, _ = cli(*argv, restore=argv[0] == root)
        assert out.count(want) == 1, out
    # restore says so, and moves no checkpoint: the shards may yet be brought together
    before, crash = listing(root), partial_dirs(root)[0]
    code, doc = cli_json(root, "--grace", "0", restore=True)
    assert code == EXIT_NO_CHECKPOINT and doc["not_shared"]["missing_ranks"] == [1]
    assert [a["path"] for a in doc["actions"]] == [str(crash)]  # rank 0's shard of a dead save
    alone = {x["path"]: x["reason"] for x in doc["left_alone"]}
    assert sorted(alone) == sorted(str(step_dir(root, s)) for s in COMMITTED)
    assert all("the shards of rank 1 are not here" in r for r in alone.values())
    assert listing(root) == sorted(
        [n for n in before if ".partial-" not in n]
        + ["quarantine", "quarantine/QUARANTINE.jsonl",
           *(f"quarantine/{n}" for n in before if ".partial-" in n)])
    code, out, _ = cli(root, "--dry-run", restore=True)
    assert out.count(HINT) == 1 and "ROOT NOT SHARED?" in out


def test_another_nodes_root_is_called_not_shared_and_left_alone(tmp_path, tmp_path_factory):
    _, other = split_over_two_nodes(tmp_path, tmp_path_factory)
    code, doc = cli_json("ls", other)
    assert code == EXIT_NO_CHECKPOINT
    assert doc["not_shared"]["message"].startswith(
        f"4 saves never committed here, and none has rank 0's shard (rank 1 wrote its): {HINT}")
    before = listing(other)
    code, doc = cli_json(other, "--grace", "0", "--delete", restore=True)
    assert code == EXIT_NO_CHECKPOINT and doc["actions"] == []
    assert len(doc["left_alone"]) == 4
    assert all("may be their only copy" in x["reason"] for x in doc["left_alone"])
    assert listing(other) == before


def test_ordinary_damage_is_not_called_not_shared(tmp_path, tmp_path_factory):
    root = copy_tree(2, tmp_path_factory, tmp_path / "ckpt")
    shard(root, 20, 1).unlink()
    code, doc = cli_json("ls", root)
    assert code == EXIT_OK and doc["not_shared"] is None
    code, out, _ = cli("ls", root)
    assert HINT not in out


def _mpmd(dirs, *argv):
    """``mpiexec`` with one rank per working directory, each running ``mpickpt ARGV``."""
    cmd = mpiexec()
    for i, d in enumerate(dirs):
        cmd += ([":"] if i else []) + ["-n", "1", "-wdir", str(d), sys.executable, "-m",
                                       "mpickpt.cli.main", *argv]
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_under_mpiexec_every_rank_must_see_the_same_root(tmp_path, tmp_path_factory):
    root, other = split_over_two_nodes(tmp_path, tmp_path_factory)
    nodes = [root.parent, other.parent]  # the same relative path "ckpt" on each "node"
    for command in (["ls", "ckpt"], ["verify", "ckpt"], ["inspect", "ckpt"]):
        p = _mpmd(nodes, *command, "--json")
        assert p.returncode == EXIT_ERROR, (p.stdout, p.stderr)
        doc = json.loads(p.stdout)
        assert doc["exit_code"] == EXIT_ERROR
        assert doc["error"].startswith("ckpt: rank 1 of this command sees another directory "
                                       "there than rank 0")
        assert HINT in doc["error"] and str(other) in doc["error"]
    # one shared directory: the same command runs (and finds rank 1's shards missing)
    p = _mpmd([root.parent, root.parent], "ls", "ckpt", "--json")
    assert p.returncode == EXIT_NO_CHECKPOINT, (p.stdout, p.stderr)
    assert json.loads(p.stdout)["not_shared"]["missing_ranks"] == [1]
    assert all(step_dir(root, s).is_dir() for s in COMMITTED)  # read-only: nothing written
    assert not any(n.startswith(".mpickpt-root-check-") for n in os.listdir(root))
