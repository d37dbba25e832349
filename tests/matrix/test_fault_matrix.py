"""The counted fault matrix: {kill, raise, hang, exit} x {rank 0, the last rank} x every fault
phase x {2, 4 ranks}, each case in real MPI jobs.

After each fault a new job restores: it must land, on every rank and bit for bit, on the newest
checkpoint whose commit completed before the fault (the new one when the fault came after the
commit), and every older checkpoint that retention (keep=2) keeps must be intact. kill and exit
must end the job, hang must end it at the collective deadline (exit 75), raise must abort the
save (or fall back in a restore) on every rank while the job goes on. Every cell is counted in
the guarantee report (suite "fault-matrix") before its assertion. See matrix_kit.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from matrix_kit import (
    ACTIONS,
    AFTER_COMMIT,
    NOT_APPLICABLE,
    PHASES,
    SIZES,
    CaseRun,
    Cell,
    cells,
    count_and_check,
    run_matrix,
)
from scheduling import matrix_fixture, matrix_group

SUITE = "fault-matrix"
WORKERS = int(os.environ.get("MPICKPT_MATRIX_WORKERS", "2"))
ALL = [c for n in SIZES for c in cells(n)]
# ./launch/test --quick: one cell of each action, on 2 ranks (retention's phase among them)
QUICK = ("kill/rank1/mid-write/n2", "raise/rank0/after-vote-before-manifest/n2",
         "hang/rank1/after-fsync-before-vote/n2", "exit/rank0/after-commit-before-retention/n2")


def proves(cell: Cell) -> pytest.MarkDecorator:
    """Every cell proves that only committed checkpoints load; a hang cell also that a hang ends
    the job, an after-commit-before-retention cell also that retention waits for the commit."""
    ids = ["no-torn-load"]
    if cell.action == "hang":
        ids.append("no-hang")
    if cell.phase == AFTER_COMMIT:
        ids.append("retention-after-commit")
    return pytest.mark.guarantee(*ids)


def marks(cell: Cell) -> list[pytest.MarkDecorator]:
    return [proves(cell), *([pytest.mark.quick] if cell.id in QUICK else [])]


def group(cell: Cell) -> str:
    """The cells run together (one worker, one batch of launches): one rank of one size."""
    return f"fault-matrix-n{cell.n}-rank{cell.rank}"


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal, past pytest's capture."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{line}")


def run_group(request: pytest.FixtureRequest, folder: Path, cells: list[Cell]
              ) -> dict[str, CaseRun]:
    """One group's cells in one batch of launches; what they took, said on the terminal."""
    t0 = time.monotonic()
    runs = run_matrix(cells, folder, WORKERS)
    launches = {id(r.launch): r.launch for r in runs.values()}
    launches |= {id(r.verify_launch): r.verify_launch for r in runs.values()}
    say(request, f"{folder.name}: {len(runs)} cells, {len(launches)} launches, "
                 f"{time.monotonic() - t0:.0f} s")
    return runs


matrix = matrix_fixture(Cell, group, run_group)


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("cell", [
    pytest.param(c, id=c.id, marks=marks(c))
    for c in ALL if c.id not in NOT_APPLICABLE])
def test_cell(matrix, guarantees, cell: Cell) -> None:
    count_and_check(guarantees, SUITE, cell, matrix[group(cell)][cell.id])


@pytest.mark.quick
def test_matrix_is_complete() -> None:
    """112 cells: every action, both ranks, every phase, both sizes; none left out unsaid."""
    assert len(ACTIONS) * 2 * len(PHASES) * len(SIZES) == 112
    assert len({c.id for c in ALL}) == len(ALL) == 112
    assert set(NOT_APPLICABLE) <= {c.id for c in ALL}
    assert all(NOT_APPLICABLE.values()), "a cell marked not applicable needs its reason"
    ran = [c for c in ALL if c.id not in NOT_APPLICABLE]
    assert len(ran) + len(NOT_APPLICABLE) == 112
    assert {c.rank for c in ran} == {0, 1, 3}
    assert set(QUICK) <= {c.id for c in ran} and {c.id.split("/")[0] for c in ALL
                                                  if c.id in QUICK} == set(ACTIONS)


@pytest.mark.quick
def test_the_scheduler_keeps_each_group_of_cells_on_one_worker() -> None:
    """tests/scheduling.py finds a cell's group from its test id as the fixture does."""
    for c in ALL:
        assert matrix_group(f"tests/matrix/test_fault_matrix.py::test_cell[{c.id}]") == group(c)


@pytest.mark.quick
def test_the_matrix_runs_this_modules_cells_once(matrix) -> None:
    """The groups hold each cell this module selected once, and no other module's: the torchrun
    matrix's cells are of the same type, and when its cells were taken too, a cell the two share
    ran twice in one directory (CI: kill/rank1/mid-manifest-write/n2, the second job found steps
    20 and 30 committed, was killed while it replaced step 30, and left only step 20)."""
    ids = [c.id for c in matrix.cells]
    assert len(ids) == len(set(ids))
    assert set(ids) <= {c.id for c in ALL}
