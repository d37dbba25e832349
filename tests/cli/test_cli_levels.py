"""mpickpt ls --local and mpickpt drain on a real node-local level.

The tree: tests/scenarios/levels.py on 4 ranks, two simulated nodes (n0: ranks 0-1, n1: ranks
2-3), partner redundancy, nothing drained by the job (persist_every None), SIGKILLed right after
its local save of step 20 is protected: both node directories hold step 20 (each its own ranks'
shards and its partner's copies), ROOT holds nothing. Made once; each test works on a copy whose
OWNER.json names the copy's ROOT.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clikit import cli, cli_json, listing
from harness import SCENARIOS, flip_data_byte, job_holding, mpiexec, run_mpi, shard, step_dir

from mpickpt.cli import EXIT_DAMAGED, EXIT_ERROR, EXIT_NO_CHECKPOINT, EXIT_OK

N = 4
STEP = 20
PLAN = {"per_node": 2, "redundancy": "partner", "persist_every": None, "steps": STEP,
        "every": 10, "timeout": 60}
_made: dict[str, Path] = {}


def run_job(root: Path, local: Path, out: Path, **plan: Any) -> list[dict[str, Any]]:
    """Run the levels scenario on 4 ranks; every rank's report (checked to exist)."""
    path = out.parent / f"{out.name}-plan.json"
    path.write_text(json.dumps({**PLAN, "root": str(root), "local": str(local),
                                "out": str(out), **plan}))
    job = run_mpi(N, [str(SCENARIOS / "levels.py"), str(path)], timeout=120)
    if plan.get("crash_after") is None:
        assert job.returncode == 0, job.output
    else:
        assert job.returncode != 0, job.output  # every rank SIGKILLed itself
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(N)]


def pristine(factory: pytest.TempPathFactory, scheme: str = "partner") -> Path:
    """base/{root,local} as the crashed job left them (do not modify). ``xor``: one rank per
    node, n0-n3, one XOR set."""
    if scheme not in _made:
        base = factory.mktemp(f"cli-levels-{scheme}")
        more = {"redundancy": "xor", "per_node": 1, "xor_set": N} if scheme == "xor" else {}
        run_job(base / "root", base / "local", base / "out", crash_after=STEP, **more)
        if scheme == "partner":
            for node in ("n0", "n1"):
                assert sorted(p.name for p in node_step(base / "local", node).iterdir()) == [
                    "LEVEL.json", "MANIFEST.json", *(f"rank-{r:05d}.h5" for r in range(N))]
        assert not list((base / "root").glob("step-*"))
        _made[scheme] = base
    return _made[scheme]


def copy_level(factory: pytest.TempPathFactory, dst: Path, scheme: str = "partner"
               ) -> tuple[Path, Path]:
    """A private copy: (ROOT, LOCAL), each node's OWNER.json naming this ROOT."""
    shutil.copytree(pristine(factory, scheme), dst)
    for owner in (dst / "local").glob("*/OWNER.json"):
        owner.write_text(json.dumps({"root": os.path.realpath(dst / "root")}))
    return dst / "root", dst / "local"


def node_step(local: Path, node: str) -> Path:
    return step_dir(local / node, STEP)


def test_ls_local_lists_the_step_on_the_nodes_and_that_root_lacks_it(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    code, doc = cli_json("ls", root)
    assert code == EXIT_NO_CHECKPOINT and "local" not in doc  # without --local: as before
    code, doc = cli_json("ls", root, "--local", local)
    assert code == EXIT_OK  # the job resumes from the nodes
    assert (doc["current"], doc["next_restore"]["step"], doc["next_restore"]["level"]) == (
        None, STEP, "local")
    lv = doc["local"]
    assert lv["path"] == str(local) and lv["error"] is None and lv["foreign"] == []
    assert [(n["name"], n["steps"], n["root"]) for n in lv["nodes"]] == [
        ("n0", [STEP], os.path.realpath(root)), ("n1", [STEP], os.path.realpath(root))]
    [s] = lv["steps"]
    assert (s["step"], s["nodes"], s["complete"], s["missing"], s["scheme"], s["drained"],
            s["world_size"]) == (STEP, ["n0", "n1"], True, [], "partner", False, N)
    assert s["bytes"] == sum(p.stat().st_size for p in node_step(local, "n0").glob("rank-*.h5"))
    code, out, _ = cli("ls", root, "--local", local)
    assert f"LOCAL {local}: 2 node directories (n0, n1)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith(str(STEP)))
    assert "partner" in row and "2 of 2" in row and "complete" in row and row.split()[-1] == "no"
    assert f"step {STEP} is complete on the nodes but not in ROOT: `mpickpt drain" in out
    # a node lost, and the survivor's copies of the other node's ranks gone: incomplete
    shutil.rmtree(local / "n1")
    for r in (2, 3):
        (node_step(local, "n0") / f"rank-{r:05d}.h5").unlink()
    code, doc = cli_json("ls", root, "--local", local)
    assert code == EXIT_NO_CHECKPOINT and doc["next_restore"]["step"] is None
    [s] = doc["local"]["steps"]
    assert (s["nodes"], s["complete"], s["missing"]) == (["n0"], False, [2, 3])
    code, out, _ = cli("ls", root, "--local", local)
    assert "1 of 2" in out and "incomplete" in out and "missing ranks 2-3" in out


@pytest.mark.quick
def test_drain_commits_the_step_and_a_restore_from_root_is_bit_exact(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    code, doc = cli_json("drain", local, root)
    final = step_dir(root, STEP)
    assert code == EXIT_OK and doc["drained"] and doc["path"] == str(final), doc
    assert doc["step"] == STEP and doc["skipped"] == [] and doc["missing"] == []
    assert [(s["rank"], s["node"]) for s in doc["shards"]] == [(0, "n0"), (1, "n0"), (2, "n1"),
                                                               (3, "n1")]
    assert listing(root) == [f"step-{STEP:08d}"]  # no partial directory left
    assert sorted(p.name for p in final.iterdir()) == [
        "MANIFEST.json", *(f"rank-{r:05d}.h5" for r in range(N))]
    assert (final / "MANIFEST.json").read_bytes() == \
        (node_step(local, "n0") / "MANIFEST.json").read_bytes()
    for r in range(N):
        assert shard(root, STEP, r).read_bytes() == \
            (node_step(local, "n0") / f"rank-{r:05d}.h5").read_bytes()
    assert cli_json("verify", root)[0] == EXIT_OK  # every checksum, and the HDF5 metadata
    code, doc = cli_json("ls", root, "--local", local)
    assert code == EXIT_OK and doc["current"] == STEP and doc["local"]["steps"][0]["drained"]
    out = cli("ls", root, "--local", local)[1]  # the same step in both: not "newer"
    assert f"will load step {STEP} from the node-local level (below), the step ROOT's newest " \
           f"is too (* = step {STEP}, its fallback)" in out, out
    out = cli("restore", root, "--local", local, "--dry-run")[1]
    assert f"(ROOT's step {STEP} too, its fallback)" in out, out
    # again: the step is in ROOT already, nothing is done
    mtime = final.stat().st_mtime_ns
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_OK and doc["already_in_root"] and not doc["drained"]
    assert listing(root) == [f"step-{STEP:08d}"] and final.stat().st_mtime_ns == mtime
    code, out, _ = cli("drain", local, root)
    assert code == EXIT_OK and f"step {STEP} is in ROOT already ({final}): nothing to do" in out
    # restored from the local level, then (the nodes gone) from ROOT: the same state, bit for bit
    from_local = run_job(root, local, tmp_path / "out-local")
    assert [(x["restore"]["step"], x["restore"]["level"]) for x in from_local] == \
        [(STEP, "local")] * N
    shutil.rmtree(local)
    from_root = run_job(root, tmp_path / "fresh-local", tmp_path / "out-root")
    assert [(x["restore"]["step"], x["restore"]["level"]) for x in from_root] == \
        [(STEP, "root")] * N
    assert all(x["restore"]["root_bytes"] > 0 for x in from_root)
    assert [x["restore"]["digest"] for x in from_root] == \
        [x["restore"]["digest"] for x in from_local]
    assert len({x["restore"]["digest"] for x in from_root}) == N  # each rank its own state


def test_drain_refuses_while_a_job_saves_into_root(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    root.mkdir(exist_ok=True)
    before = listing(root)
    with job_holding(root) as pid:
        code, doc = cli_json("drain", local, root)
        assert code == EXIT_ERROR and not doc["drained"], doc
        assert f"process {pid} (" in doc["error"] and "nothing was drained" in doc["error"]
        assert listing(root) == before
    code, doc = cli_json("drain", local, root)  # the job is gone
    assert code == EXIT_OK and doc["drained"] and listing(root) == [f"step-{STEP:08d}"]


def test_drain_with_a_node_wiped_takes_the_partner_copies(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    shutil.rmtree(local / "n1")
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_OK and doc["drained"], doc
    assert {s["node"] for s in doc["shards"]} == {"n0"}
    assert cli_json("verify", root)[0] == EXIT_OK


def test_a_damaged_copy_is_skipped_for_the_intact_one(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    bad0, tensor = flip_data_byte(local / "n0", STEP, 0)
    bad1, _ = flip_data_byte(local / "n1", STEP, 0)
    # every copy of rank 0 damaged: refused, ROOT unchanged
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_DAMAGED and not doc["drained"] and doc["missing"] == [0], doc
    assert "every copy of the shard of rank 0" in doc["error"]
    assert f"rank 0: {bad0}: tensor '{tensor}': checksum mismatch" in doc["error"]
    assert str(bad1) in doc["error"] and listing(root) == []
    flip_data_byte(local / "n1", STEP, 0)  # n1's copy intact again
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_OK and doc["drained"], doc
    assert [(k["rank"], k["node"], k["file"]) for k in doc["skipped"]] == [(0, "n0", str(bad0))]
    assert [s["node"] for s in doc["shards"] if s["rank"] == 0] == ["n1"]
    assert shard(root, STEP, 0).read_bytes() == bad1.read_bytes()
    assert cli_json("verify", root)[0] == EXIT_OK
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_OK and doc["already_in_root"]


def test_drain_refuses_when_no_step_is_complete(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    shutil.rmtree(local / "n1")
    (node_step(local, "n0") / "rank-00002.h5").unlink()
    os.truncate(node_step(local, "n0") / "rank-00003.h5", 1000)
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_ERROR and not doc["drained"] and doc["missing"] == [2, 3], doc
    why = doc["error"]
    assert "no checkpoint on the nodes is complete" in why
    assert "no node directory seen holds the shard of ranks 2-3 (their node: n1)" in why
    assert "rank-00003.h5 has 1000 bytes" in why
    assert "restart of the job rebuilds XOR-protected shards" in why and "close()" in why
    assert listing(root) == []
    code, _, err = cli("drain", local, root)
    assert code == EXIT_ERROR and "ranks 2-3" in err
    code, doc = cli_json("drain", local, root, "--step", "30")
    assert code == EXIT_ERROR and "holds a committed step 30 (steps on the nodes: 20)" in \
        doc["error"]


def test_drain_refuses_the_local_level_of_another_root(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    other = tmp_path / "other"
    code, doc = cli_json("drain", local, other)
    assert code == EXIT_ERROR and not doc["drained"]
    assert f"{local / 'n0' / 'OWNER.json'}: the node directory n0 holds the checkpoints of " \
        f"ROOT {os.path.realpath(root)}, not of {other}" in doc["error"]
    assert "and 1 more node directory" in doc["error"]
    assert not other.exists() and listing(root) == []
    code, doc = cli_json("drain", tmp_path / "nowhere", root)
    assert code == EXIT_ERROR and "no such directory" in doc["error"]


def test_xor_a_lost_node_is_named_and_left_to_the_jobs_rebuild(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t", "xor")
    assert sorted(p.name for p in node_step(local, "n3").iterdir()) == [
        "LEVEL.json", "MANIFEST.json", "rank-00003.h5", "xor-00003.bin"]
    code, doc = cli_json("ls", root, "--local", local)
    [s] = doc["local"]["steps"]
    assert (s["nodes"], s["scheme"], s["complete"]) == (["n0", "n1", "n2", "n3"], "xor", True)
    saved = tmp_path / "n3"
    shutil.move(local / "n3", saved)  # the node is lost
    code, doc = cli_json("ls", root, "--local", local)  # the job rebuilds rank 3 from parity
    assert (doc["next_restore"]["step"], doc["next_restore"]["level"]) == (STEP, "local")
    assert doc["local"]["steps"][0]["rebuildable"] and code == EXIT_OK
    code, out, _ = cli("ls", root, "--local", local)
    assert "3 of 4" in out and "rebuildable" in out
    assert "step 20 lacks the shards of rank 3 (their node: n3): a restart of the job " \
        "rebuilds them from XOR parity and drains at close()" in out
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_ERROR and doc["missing"] == [3] and listing(root) == []
    assert "Its redundancy is XOR parity: a restart of the job with this local level rebuilds " \
        "the missing shards" in doc["error"]
    shutil.move(saved, local / "n3")  # seen again: drained, the parity left on the nodes
    code, doc = cli_json("drain", local, root)
    assert code == EXIT_OK and doc["drained"]
    assert sorted(p.name for p in step_dir(root, STEP).iterdir()) == [
        "MANIFEST.json", *(f"rank-{r:05d}.h5" for r in range(N))]
    assert cli_json("verify", root)[0] == EXIT_OK


def _per_node(argv: list[str], dirs: list[Path]) -> subprocess.CompletedProcess[str]:
    """``mpickpt ARGV`` under mpiexec, one process per directory, each started in its own (as one
    process per node, each seeing only its node's LOCAL)."""
    cmd = mpiexec()
    for i, d in enumerate(dirs):
        cmd += [*([":"] if i else []), "-n", "1", "-wdir", str(d), sys.executable, "-m",
                "mpickpt.cli.main", *argv]
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                          start_new_session=True)


def test_drain_under_mpiexec_one_process_per_node(tmp_path, tmp_path_factory):
    root, local = copy_level(tmp_path_factory, tmp_path / "t")
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    for d, node in zip(nodes, ("n0", "n1"), strict=True):
        (d / "local").mkdir(parents=True)
        shutil.move(local / node, d / "local" / node)
    bad, _ = flip_data_byte(nodes[0] / "local" / "n0", STEP, 0)  # node a's copy of rank 0
    p = _per_node(["ls", str(root), "--local", "local", "--json"], nodes)
    assert p.returncode == EXIT_OK, p.stderr  # the job resumes from the nodes
    assert json.loads(p.stdout)["next_restore"]["step"] == STEP
    lv = json.loads(p.stdout)["local"]
    assert [(n["name"], n["process"]) for n in lv["nodes"]] == [("n0", 0), ("n1", 1)]
    assert lv["steps"][0]["complete"] and lv["steps"][0]["nodes"] == ["n0", "n1"]
    p = _per_node(["drain", "local", str(root), "--json"], nodes)
    assert p.returncode == EXIT_OK, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    # each shard copied by the process of its own node, rank 0 from node b after a's failed
    assert [(s["rank"], s["node"], s["process"]) for s in doc["shards"]] == [
        (0, "n1", 1), (1, "n0", 0), (2, "n1", 1), (3, "n1", 1)]
    assert [(k["rank"], k["file"]) for k in doc["skipped"]] == [(0, str(bad))]
    assert cli_json("verify", root)[0] == EXIT_OK
    p = _per_node(["drain", "local", str(root)], nodes)
    assert p.returncode == EXIT_OK and "in ROOT already" in p.stdout, p.stderr
    # rank 0's node replaced (its directory empty): the other process holds every shard (partner
    # copies) and the manifest, and copies them all
    root, local = copy_level(tmp_path_factory, tmp_path / "t2")
    nodes = [tmp_path / "node-c", tmp_path / "node-d"]
    (nodes[0] / "local").mkdir(parents=True)
    (nodes[1] / "local").mkdir(parents=True)
    shutil.move(local / "n1", nodes[1] / "local" / "n1")
    p = _per_node(["drain", "local", str(root), "--json"], nodes)
    assert p.returncode == EXIT_OK, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert {(s["node"], s["process"]) for s in doc["shards"]} == {("n1", 1)}
    assert cli_json("verify", root)[0] == EXIT_OK


def _restores(root: Path, local: Path, out: Path) -> tuple[int, str]:
    """What a restart of the job loads now: (step, level), the same on every rank (a job that
    restores and exits, saving nothing)."""
    reports = run_job(root, local, out, verify=True)
    got = {(x["restore"]["step"], x["restore"]["level"]) for x in reports}
    assert len(got) == 1 and all(x["restore"]["exact"] for x in reports), reports
    return got.pop()


def test_the_tools_predict_what_the_job_loads_and_a_rollback_wins_over_every_level(tmp_path):
    """ROOT holds steps 20 and 40 (drained), the nodes 50 (protected, never drained). The tools
    say the job loads 50 from the nodes, and it does. `mpickpt-restore --step 20` then undoes
    40 in ROOT and 50 on the nodes: the tools say 20, the job loads 20 (and discards 50 on every
    node), and a save made after the rollback counts again: the nodes' new 40 is loaded next."""
    root, local = tmp_path / "root", tmp_path / "local"
    run_job(root, local, tmp_path / "crash", persist_every=2, steps=50, crash_after=50)
    assert [n for n in listing(root) if n.startswith("step-")] == ["step-00000020", "step-00000040"]
    code, doc = cli_json("ls", root, "--local", local)
    assert code == EXIT_OK and doc["current"] == 40
    assert (doc["next_restore"]["step"], doc["next_restore"]["level"]) == (50, "local")
    code, doc = cli_json(root, "--local", local, "--dry-run", restore=True)
    assert code == EXIT_OK and (doc["resume"]["step"], doc["resume"]["level"]) == (50, "local")
    assert _restores(root, local, tmp_path / "look1") == (50, "local")

    code, doc = cli_json(root, "--step", "20", "--local", local, restore=True)
    assert code == EXIT_OK and doc["rollback"]["to_step"] == 20
    assert (doc["next_restore"]["step"], doc["next_restore"]["level"]) == (20, "root")
    assert doc["local"]["undone"] == [50]
    code, out, _ = cli(root, "--step", "20", "--local", local, "--dry-run", restore=True)
    assert "step(s) 50 would be undone by the rollback" in out
    code, doc = cli_json("ls", root, "--local", local)
    assert (doc["next_restore"]["step"], doc["next_restore"]["level"]) == (20, "root")
    code, out, _ = cli("ls", root, "--local", local)
    assert "undone by ROLLBACK.json rolled back to step 20" in out and "undone" in out

    # the job: 20, and 50 discarded on both nodes; then it saves 30 and 40 on the nodes (drained
    # every third: never) and dies
    job = run_job(root, local, tmp_path / "resume", persist_every=3, steps=60, crash_after=40)
    assert {(x["restore"]["step"], x["restore"]["level"]) for x in job} == {(20, "root")}
    assert all(x["restore"]["exact"] for x in job)
    for node in ("n0", "n1"):
        assert [p.name for p in sorted((local / node).glob("step-*"))] == ["step-00000040"]
    code, doc = cli_json("ls", root, "--local", local)
    assert (doc["next_restore"]["step"], doc["next_restore"]["level"]) == (40, "local")
    assert _restores(root, local, tmp_path / "look2") == (40, "local")
