"""The counted fault matrix of the node-local level: {kill, raise, hang} x {rank 0, the last rank}
x every phase the level adds (its local write, the redundancy exchange, the local commit, the
drain's copy and the drain's commit in ROOT), on 4 ranks as 2 simulated nodes with partner
redundancy, each cell in real MPI jobs (tests/scenarios/levels.py). The last rank's cells save
a replicated model (DDP's layout), rank 0's a per-rank one: every fault in every phase is tried
with both.

The job saves steps 10, 20 and 30 into the local level (step 20 is drained to ROOT as the second
save; step 30 only at close()), with the fault armed for step 30: in its save, or in the drain of
it at close. kill and hang must end the job (hang at the deadline, exit 75), raise must leave it
running to a normal end. Then a new job restores (the local level first) and must land, on every
rank and bit for bit, on the newest step whose local commit completed: 20 after a fault in the
save of 30, 30 after one in its drain, either after a kill or hang amid the local commit (one
node may have published it; all shards were protected by then). And ROOT alone: every step it
shows must restore bit for bit (a drain stopped anywhere never shows). Every cell is counted in
the guarantee report (suite "level-fault-matrix") before its assertions.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import SCENARIOS, Job, run_mpi
from scheduling import matrix_fixture, matrix_group

from mpickpt.exitcodes import EXIT_COLLECTIVE_TIMEOUT
from mpickpt.faults import LEVEL_PHASES
from mpickpt.format import rootdir

JOB = SCENARIOS / "levels.py"
SUITE = "level-fault-matrix"
N, PER_NODE = 4, 2
PHASES = ("mid-write", *LEVEL_PHASES)
ACTIONS = ("kill", "raise", "hang")
DRAIN_PHASES = ("mid-drain", "mid-drain-commit")
WORKERS = int(os.environ.get("MPICKPT_MATRIX_WORKERS", "2"))


@dataclass(frozen=True)
class LevelCell:
    action: str
    rank: int
    phase: str

    @property
    def replicated(self) -> bool:
        """The cells of the last rank save a model replicated on every rank (DDP's layout,
        ``replicated=("model",)``): each rank writes a share, and a restore from the local
        level takes the other nodes' shares over MPI."""
        return self.rank == N - 1

    @property
    def id(self) -> str:
        return f"{self.action}/rank{self.rank}/{self.phase}" + (
            "/replicated" if self.replicated else "")

    def expected(self) -> set[int]:
        if self.phase in DRAIN_PHASES:
            return {30}
        if self.phase == "mid-local-commit" and self.action != "raise":
            return {20, 30}
        return {20}


CELLS = [LevelCell(a, r, p) for a in ACTIONS for r in (0, N - 1) for p in PHASES]


@dataclass
class CellRun:
    fault: Job
    verify: Job
    reports: dict[int, dict]
    unmanifested: list[int]  # step directories in ROOT without a manifest, after the fault


def run_cell(cell: LevelCell, base: Path) -> CellRun:
    where = base / cell.id.replace("/", "-")
    where.mkdir(parents=True)
    plan = {"root": str(where / "root"), "local": str(where / "local"), "per_node": PER_NODE,
            "redundancy": "partner", "persist_every": 2, "steps": 30, "every": 10,
            "timeout": 3 if cell.action == "hang" else 30, "replicated": cell.replicated,
            "fault": f"{cell.phase}:{cell.rank}:{cell.action}:30"}
    (where / "fault.json").write_text(json.dumps(plan))
    fault = run_mpi(N, [str(JOB), str(where / "fault.json")], timeout=90,
                    env={"MPICKPT_TIMEOUT_GRACE": "2"})
    unmanifested = sorted(
        {s for s, _ in rootdir.committed(plan["root"], require_manifest=False)}
        - {s for s, _ in rootdir.committed(plan["root"])})
    verify_plan = {**plan, "fault": "", "verify": True, "timeout": 30,
                   "out": str(where / "verify")}
    (where / "verify.json").write_text(json.dumps(verify_plan))
    verify = run_mpi(N, [str(JOB), str(where / "verify.json")], timeout=90)
    reports = {}
    for r in range(N):
        f = where / "verify" / f"rank-{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    return CellRun(fault, verify, reports, unmanifested)


def group(cell: LevelCell) -> str:
    """The cells run together (one worker): one action on one rank."""
    return f"level-matrix-{cell.action}-rank{cell.rank}"


def run_group(_request: pytest.FixtureRequest, folder: Path, cells: list[LevelCell]
              ) -> dict[str, CellRun]:
    """One group's cells, WORKERS at a time."""
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip([c.id for c in cells], pool.map(lambda c: run_cell(c, folder), cells),
                        strict=True))


matrix = matrix_fixture(LevelCell, group, run_group)


def judge(cell: LevelCell, run: CellRun) -> str:
    reps = run.reports
    if run.verify.returncode != 0 or len(reps) != N:
        return "failed"
    steps = {rep["restore"]["step"] for rep in reps.values()}
    if len(steps) != 1:
        return "torn"
    if not all(rep["restore"]["exact"] for rep in reps.values()):
        return "silent-wrong"
    if run.unmanifested or not all(all(rep["root_steps"].values()) for rep in reps.values()):
        return "silent-wrong"
    return "correct" if steps <= cell.expected() else "failed"


def proves(cell: LevelCell) -> pytest.MarkDecorator:
    ids = ["no-torn-load", "root-shows-committed-drains"]
    if cell.action == "hang":
        ids.append("no-hang")
    return pytest.mark.guarantee(*ids)


# ./launch/test --quick: one cell of each action; a drain among them, a replicated one too
QUICK = ("kill/rank3/mid-drain/replicated", "raise/rank0/mid-exchange",
         "hang/rank3/mid-local-commit/replicated")


def marks(cell: LevelCell) -> list[pytest.MarkDecorator]:
    return [proves(cell), *([pytest.mark.quick] if cell.id in QUICK else [])]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cell", [
    pytest.param(c, id=c.id, marks=marks(c))
    for c in CELLS])
def test_cell(matrix, guarantees, cell: LevelCell) -> None:
    run = matrix[group(cell)][cell.id]
    guarantees.record(SUITE, cell.id, judge(cell, run), run.verify.output[-1500:])
    fault = run.fault
    if cell.action == "raise":
        assert fault.returncode == 0, fault.output
    elif cell.action == "hang":
        assert fault.returncode == EXIT_COLLECTIVE_TIMEOUT, fault.output
    else:
        assert fault.returncode != 0, fault.output
    assert run.verify.returncode == 0, run.verify.output
    restored = {r: rep["restore"] for r, rep in run.reports.items()}
    assert len(restored) == N
    steps = {r["step"] for r in restored.values()}
    assert len(steps) == 1 and steps <= cell.expected(), restored
    assert all(r["exact"] for r in restored.values())
    assert {r["level"] for r in restored.values()} == {"local"}
    root_steps = run.reports[0]["root_steps"]
    assert "20" in root_steps and set(root_steps) <= {"20", "30"}, root_steps
    assert all(all(rep["root_steps"].values()) for rep in run.reports.values())
    assert run.unmanifested == []


@pytest.mark.quick
def test_the_matrix_covers_every_phase_of_the_local_level() -> None:
    assert set(LEVEL_PHASES) <= {c.phase for c in CELLS}
    assert len(CELLS) == len(ACTIONS) * 2 * len(PHASES) == 36
    assert set(QUICK) <= {c.id for c in CELLS}
    assert {c.action for c in CELLS if c.id in QUICK} == set(ACTIONS)


@pytest.mark.quick
def test_the_scheduler_keeps_each_group_of_cells_on_one_worker() -> None:
    """tests/scheduling.py finds a cell's group from its test id as the fixture does."""
    for c in CELLS:
        assert matrix_group(f"tests/matrix/test_level_matrix.py::test_cell[{c.id}]") == group(c)
