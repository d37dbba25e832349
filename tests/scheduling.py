"""How pytest-xdist spreads the suite over its workers (``./launch/test`` runs ``-n 3``).

The unit of work is :func:`unit`: a worker runs a whole unit, so a module's module- and
session-scoped fixtures (reference runs, trees, the matrices' jobs) are made once, on one
worker. A unit is a test module, except:

* every module of ``tests/slurm``: one unit, since the session has one Slurm to drive;
* the fault matrices: groups of cells (:func:`matrix_group`, which the matrix modules' own
  fixtures use to batch their jobs), so that their cells spread over the workers.

Units start costliest first (:data:`HEAVY`, measured; the rest in collection order), so that the
long ones do not come last and leave the other workers idle at the end.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAULT_CELL = re.compile(
    r"^tests/matrix/test_fault_matrix\.py::test_cell\[(\w+)/rank(\d+)/[^/\]]+/n(\d+)\]$")
LEVEL_CELL = re.compile(r"^tests/matrix/test_level_matrix\.py::test_cell\[(\w+)/rank(\d+)/")

# the costliest units, costliest first (as a full run's --durations measured them on a 2-core
# machine); a unit not named here starts after these, in collection order
HEAVY = (
    "slurm", "tests/matrix/test_fault_matrix_torchrun.py", "tests/faults/test_fault_many_ranks.py",
    "tests/multirank/test_levels.py",
    "level-matrix-hang-rank", "fault-matrix-n4", "level-matrix-kill-rank",
    "tests/integrations/test_hf.py", "tests/integrations/test_lightning.py",
    "fault-matrix-n2", "level-matrix-raise-rank", "tests/multirank/test_preemption.py",
    "tests/multirank/test_deadlines.py", "tests/faults/test_fault_kill.py",
    "tests/multirank/test_ddp.py", "tests/multirank/test_torchrun.py",
    "tests/multirank/test_roundtrip.py",
    "tests/faults/test_fault_disk.py", "tests/faults/test_fault_incremental.py",
)


def matrix_group(nodeid: str) -> str | None:
    """The group of a fault-matrix cell's test (its jobs run together), or None."""
    m = FAULT_CELL.match(nodeid)
    if m:
        return f"fault-matrix-n{m.group(3)}-rank{m.group(2)}"
    m = LEVEL_CELL.match(nodeid)
    if m:
        return f"level-matrix-{m.group(1)}-rank{m.group(2)}"
    return None


class ByGroup(dict):
    """A matrix fixture's runs by group of cells (:func:`matrix_group`: under pytest-xdist a
    group's cells go to one worker): group -> {cell id: run}. The cells are those of type
    ``kind`` that the session selected in the fixture's own module (two matrix modules share
    the cell type: the torchrun matrix's cells are not this module's); ``run(group, cells)``
    runs one group's on first use, so that a worker runs only the groups it was given."""

    def __init__(self, request: Any, kind: type, group: Callable[[Any], str],
                 run: Callable[[str, list], dict]) -> None:
        super().__init__()
        self.cells = [item.callspec.params["cell"] for item in request.session.items
                      if getattr(item, "module", None) is request.module
                      and getattr(item, "callspec", None)
                      and isinstance(item.callspec.params.get("cell"), kind)]
        self._group, self._run = group, run

    def __missing__(self, group: str) -> dict:
        self[group] = self._run(group, [c for c in self.cells if self._group(c) == group])
        return self[group]


def matrix_fixture(kind: type, group: Callable[[Any], str],
                   run: Callable[[Any, Path, list], dict]) -> Any:
    """A matrix module's fixture: its cells (of type ``kind``) that the session selected, run by
    ``run(request, folder, cells)`` one group (``group(cell)``) at a time, on first use, each
    group in a folder of its own (a :class:`ByGroup`)."""
    import pytest

    @pytest.fixture(scope="module")
    def matrix(request: Any, tmp_path_factory: Any) -> ByGroup:
        base = tmp_path_factory.mktemp(kind.__name__.lower())
        return ByGroup(request, kind, group, lambda g, cells: run(request, base / g, cells))

    return matrix


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to (see the module's docstring)."""
    if nodeid.startswith("tests/slurm/"):
        return "slurm"
    return matrix_group(nodeid) or nodeid.split("::", 1)[0]


def cost_rank(unit_name: str) -> int:
    """Where a unit starts: its place in :data:`HEAVY` (by prefix), else after them all."""
    return next((i for i, h in enumerate(HEAVY) if unit_name.startswith(h)), len(HEAVY))


def make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with :func:`unit` as the scope and the units queued by
        :func:`cost_rank` (its ``schedule`` less the reordering by size)."""

        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(unit(nodeid), {})[nodeid] = False
            for name in sorted(units, key=cost_rank):  # stable: collection order within a rank
                self.workqueue[name] = units[name]
            for _ in range(max(0, len(self.nodes) - len(self.workqueue))):
                unused, _assigned = self.assigned_work.popitem()
                unused.shutdown()
            for node in self.nodes:  # two tests or more each to start, more as they finish:
                # a worker holds its last test back until it is sent another or told to stop
                self._assign_work_unit(node)
                while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                    self._assign_work_unit(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return UnitScheduling(config, log)
