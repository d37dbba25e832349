"""Jobs started by torchrun, without MPI: mpickpt's protocol over gloo groups of its own.

A 4-rank job killed in the middle of a save resumes bit for bit (the README's demo, under
torchrun); its kind of checkpoint restores on 2 ranks with every sharded and replicated tensor
resharded; the package imports and saves with no MPI library at all; ``mpickpt.run`` under
torchrun ends the job as it says. The fault matrix under torchrun is
tests/matrix/test_fault_matrix_torchrun.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, SCENARIOS, torchrun, torchrun_code

DEMO = REPO / "launch" / "demo.py"


def run_torchrun(n: int, args: list[str], *, env: dict[str, str] | None = None,
                 timeout: float = 180, py: list[str] | None = None
                 ) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    full.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        return subprocess.run([*torchrun(n, py), *args], capture_output=True, text=True, env=full,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun {args} hung for {timeout} s\n{e.stdout}\n{e.stderr}")


@pytest.mark.guarantee("resume-bit-identical", "no-torn-load")
def test_a_job_killed_mid_save_resumes_bit_for_bit_under_torchrun(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, str(DEMO), "--launcher", "torchrun", "--workdir",
                        str(work)], capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert ("RESULT: the resumed run matches the uninterrupted run bit for bit (4 ranks, 40 "
            "steps; rank 2 killed while saving step 30, resumed from step 20)") in out, out[-3000:]
    assert "torchrun reports exit code 1" in out  # the job died with the killed rank


@pytest.mark.quick
@pytest.mark.guarantee("reshard-bit-exact")
def test_a_checkpoint_of_4_torchrun_ranks_restores_on_2(tmp_path: Path) -> None:
    scenario, root = str(SCENARIOS / "reshard.py"), tmp_path / "root"
    saved = run_torchrun(4, [scenario, "save", str(root), str(tmp_path / "s")])
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    got = run_torchrun(2, [scenario, "restore", str(root), str(tmp_path / "r")])
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    for r in range(2):
        rep = json.loads((tmp_path / "r" / f"restore-rank-{r}.json").read_text())
        assert rep["step"] == 7 and rep["saved_by"] == 4, rep
        assert rep["rows"] and rep["cols"] and rep["rep"] and rep["mine"], rep
        assert rep["note"] == f"saved by rank {r}", rep


NO_MPI = """\
import importlib.abc, sys
class NoMPI(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ModuleNotFoundError(f"No module named {name!r} (this test has no MPI)")
sys.meta_path.insert(0, NoMPI())
"""

JOB = """\
import os, sys, torch, mpickpt
assert mpickpt.backend() == "torch", mpickpt.backend()
rank = int(os.environ["RANK"])
state = {"w": torch.full((4, 4), float(rank)), "step": 0}
with mpickpt.Checkpointer(sys.argv[1], keep=1) as ck:
    start = ck.restore(state) or 0
    state["w"] += 1
    state["step"] = start + 1
    assert ck.save(start + 1, state).wait().committed
print(f"rank {rank}: step {state['step']}, w {state['w'][0, 0].item()}, "
      f"mpi4py imported: {any(m.startswith('mpi4py') for m in sys.modules)}", flush=True)
"""


def test_without_any_mpi_library_the_package_imports_and_runs_under_torchrun(
        tmp_path: Path) -> None:
    """mpi4py cannot be imported at all (a finder refuses it, as if no MPI were installed):
    two torchrun jobs save and resume, and no rank imported mpi4py."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_MPI)
    (tmp_path / "job.py").write_text(JOB)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "MPICKPT_WARM": "0"}
    for step in (1, 2):
        p = run_torchrun(2, ["-c", "import mpi4py"], env=env, py=[sys.executable])
        assert p.returncode != 0 and "this test has no MPI" in p.stdout + p.stderr
        p = run_torchrun(2, [str(tmp_path / "job.py"), str(tmp_path / "root")], env=env,
                         py=[sys.executable])
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-3000:]
        for r in range(2):
            assert f"rank {r}: step {step}, w {r + step}.0, mpi4py imported: False" in out, out


RUN_JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
if sys.argv[1] == "raise" and rank == 1:
    raise RuntimeError("boom on rank 1")
if sys.argv[1] == "raise":
    time.sleep(60)  # the others wait, as in a collective: the agent must end them
if sys.argv[1] == "exit3":
    sys.exit(3)
print(f"rank {rank} done", flush=True)
"""


@pytest.mark.parametrize(("mode", "code"), [("ok", 0), ("raise", 1), ("exit3", 3)])
def test_mpickpt_run_under_torchrun_ends_the_job_with_the_ranks_code(
        tmp_path: Path, mode: str, code: int) -> None:
    (tmp_path / "job.py").write_text(RUN_JOB)
    p = run_torchrun(3, ["-m", "mpickpt.run", str(tmp_path / "job.py"), mode], timeout=120)
    out = p.stdout + p.stderr
    assert torchrun_code(p.returncode, out) == code, out[-3000:]
    if mode == "raise":
        assert "[rank 1] RuntimeError: boom on rank 1" in out
        assert "[rank 1] mpickpt.run: uncaught RuntimeError; aborting the job with exit code 1" \
            in out
    if mode == "ok":
        assert all(f"rank {r} done" in out for r in range(3)), out


TITAN = REPO / "examples" / "torchtitan_style.py"


@pytest.mark.guarantee("resume-bit-identical")
def test_the_torchtitan_style_example_killed_mid_save_resumes_bit_for_bit(
        tmp_path: Path) -> None:
    """examples/torchtitan_style.py (DCP's calls through mpickpt.dcp) on 2 torchrun ranks:
    30 steps straight; 20 steps; then on to 30 with rank 1 killed while writing step 30's
    checkpoint; a restart loads step 20 and ends bit-identical to the straight run."""
    import torch

    def run(folder: str, steps: int, out: str, fault: str | None = None) -> str:
        env = {"MPICKPT_FAULT": fault} if fault else {}
        p = run_torchrun(2, [str(TITAN), "--folder", str(tmp_path / folder), "--steps",
                             str(steps), "--out", str(tmp_path / out)], env=env)
        assert (p.returncode != 0) == bool(fault), (p.stdout + p.stderr)[-3000:]
        return p.stdout + p.stderr

    run("ref", 30, "ref-out")
    run("ck", 20, "first")
    # the step-30 id's first (internal) save is its step 0
    out = run("ck", 30, "killed", fault="mid-write:1:kill:0")
    assert torchrun_code(1, out) == -9, out[-2000:]
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-20", "step-30"]  # keep=2
    assert not any(n.startswith("step-") and "partial" not in n
                   for n in os.listdir(tmp_path / "ck" / "step-30")), "step 30 committed"
    out = run("ck", 30, "resumed")
    assert "training steps 21..30 on 2 ranks" in out, out[-2000:]
    for r in range(2):
        a = torch.load(tmp_path / "ref-out" / f"rank-{r}.pt", weights_only=True)
        b = torch.load(tmp_path / "resumed" / f"rank-{r}.pt", weights_only=True)
        assert a["losses"] == b["losses"] and a["batches"] == b["batches"] == 30
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        sa, sb = a["optim"]["state"], b["optim"]["state"]
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.mark.guarantee("local-survives-node-loss")
@pytest.mark.parametrize(("scheme", "n"), [("partner", 4), ("xor", 6)])
def test_the_local_level_rebuilds_a_lost_node_over_gloo(tmp_path: Path, scheme: str,
                                                        n: int) -> None:
    """Two ranks per simulated node; the level's copies (partner) or parity (XOR) cross over
    gloo; node n1's directory is wiped between the jobs and every rank still restores step 2
    from the level, bit for bit."""
    scenario = str(SCENARIOS / "torchrun_level.py")
    root, local, reports = tmp_path / "root", tmp_path / "local", tmp_path / "rep"
    for mode in ("save", "restore"):
        p = run_torchrun(n, [scenario, str(root), str(local), scheme, mode, str(reports)])
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        if mode == "save":
            for r in range(n):
                rep = json.loads((reports / f"save-rank-{r}.json").read_text())
                assert rep["save-2"] == [True, "local"], rep
            shutil.rmtree(local / "n1")  # the lost node: its ranks' files are gone
    assert "rebuilding the shards of ranks 2-3 from the local level's redundancy" in p.stderr
    for r in range(n):
        rep = json.loads((reports / f"restore-rank-{r}.json").read_text())
        assert rep == {"rank": r, "step": 2, "level": "local", "exact": True}, rep
