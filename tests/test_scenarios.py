"""The programs in tests/scenarios/ are named after the tests that run them.

``test_M.py`` runs ``M.py`` or ``M_WHAT.py``; a program that several test modules run is named for
what they share. Every program's docstring says which modules run it (``Run by tests/...``), and
that list is exactly the test modules that name the program, directly or through a helper module
they import (such as tests/matrix/matrix_kit.py). What the programs share is in ``_*.py`` beside
them, which are not programs. No MPI: the files are only read.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from harness import REPO, SCENARIOS

PROGRAMS = sorted(p for p in SCENARIOS.glob("*.py") if not p.name.startswith("_"))
RUN_BY = re.compile(r"Run by (.*?)\.(?:\s|$)", re.S)


def sources() -> dict[str, str]:
    """Every Python file of tests/ but the scenarios and this one: path -> text."""
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in sorted((REPO / "tests").rglob(
        "*.py")) if SCENARIOS not in p.parents and p != Path(__file__).resolve()}


def names(text: str, program: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(program)}\b", text) is not None


def imports(text: str, module: str) -> bool:
    return re.search(rf"^(from {module} import|import {module}\b)", text, re.M) is not None


def runners(program: Path) -> set[str]:
    """The test modules that name ``program``, or import a helper module that does."""
    files = sources()
    helpers = [Path(p).stem for p, text in files.items()
               if not Path(p).name.startswith("test_") and names(text, program.name)]
    return {p for p, text in files.items() if Path(p).name.startswith("test_") and (
        names(text, program.name) or any(imports(text, h) for h in helpers))}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_a_scenario_says_which_tests_run_it_and_is_named_after_them(program: Path):
    doc = ast.get_docstring(ast.parse(program.read_text())) or ""
    said = RUN_BY.search(doc)
    assert said, f"{program.name}: its docstring does not say 'Run by tests/.../test_M.py.'"
    stated = set(re.findall(r"tests/(?:\w+/)*test_\w+\.py", said.group(1)))
    found = runners(program)
    assert found, f"no test module runs {program.name}"
    assert stated == found, (f"{program.name} says it is run by {sorted(stated)}; the modules "
                             f"that name it are {sorted(found)}")
    if len(found) == 1:
        module = Path(found.pop()).stem.removeprefix("test_")
        assert program.stem == module or program.stem.startswith(f"{module}_"), \
            f"{program.name} is run by test_{module}.py only: name it {module}.py or {module}_*.py"
