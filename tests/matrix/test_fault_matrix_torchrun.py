"""The fault matrix under torchrun: the same cells, job and judge as test_fault_matrix.py, with
every job started by ``torchrun -m mpickpt.run`` and no MPI at all (mpickpt's protocol over its
own gloo groups; the scenario's barriers over the training's default gloo group).

CI runs a reduced form (:data:`CI`: every phase of kill, raise and exit on the last of 2 ranks,
hang at two phases on each rank of 2, and kill mid-write on the last of 4), since under
torchrun a hung rank ignores the agent's SIGTERM (it only raises the preemption flag) and costs
the agent's 30 s before its SIGKILL. ``MPICKPT_MATRIX_TORCHRUN=full`` runs all 112 cells.
Counted in the guarantee report as the suite "fault-matrix-torchrun".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from matrix_kit import (
    ACTIONS,
    NOT_APPLICABLE,
    PHASES,
    Cell,
    cells,
    count_and_check,
    run_matrix,
)
from scheduling import matrix_fixture
from test_fault_matrix import SIZES, WORKERS, proves, say

SUITE = "fault-matrix-torchrun"
ALL = [c for n in SIZES for c in cells(n)]
CI = {c.id for c in ALL if c.n == 2 and c.rank == 1 and c.action != "hang"} | {
    f"hang/rank{r}/{p}/n2" for r in (0, 1) for p in ("mid-write", "after-fsync-before-vote")
} | {"kill/rank3/mid-write/n4"}
FULL = os.environ.get("MPICKPT_MATRIX_TORCHRUN") == "full"
RUN = [c for c in ALL if c.id not in NOT_APPLICABLE and (FULL or c.id in CI)]


def group(cell: Cell) -> str:
    return f"torchrun-n{cell.n}"


def run_group(request: pytest.FixtureRequest, folder: Path, todo: list[Cell]) -> dict:
    runs = run_matrix(todo, folder, WORKERS, how="torchrun")
    say(request, f"{folder.name}: {len(runs)} cells under torchrun")
    return runs


matrix = matrix_fixture(Cell, group, run_group)


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id, marks=[proves(c)]) for c in RUN])
def test_cell(matrix, guarantees, cell: Cell) -> None:
    count_and_check(guarantees, SUITE, cell, matrix[group(cell)][cell.id])


@pytest.mark.quick
def test_the_ci_form_covers_every_action_and_phase() -> None:
    """The reduced form still meets every action, every phase, and both rank counts."""
    ci = [c for c in ALL if c.id in CI]
    assert len(ci) == len(CI) == 7 * 3 + 4 + 1
    assert {c.action for c in ci} == set(ACTIONS)
    assert {c.phase for c in ci} == set(PHASES)
    assert {c.n for c in ci} == set(SIZES)


@pytest.mark.quick
def test_the_matrix_runs_this_modules_cells_once(matrix) -> None:
    """Only this module's cells, each once: not test_fault_matrix.py's (the same type), which
    would run all of its cells, hang cells and all, under torchrun as well."""
    ids = [c.id for c in matrix.cells]
    assert len(ids) == len(set(ids))
    assert set(ids) <= {c.id for c in RUN}
