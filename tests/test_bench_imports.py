"""Every name a benchmark or probe in ``bench/`` imports from mpickpt exists: a name moved or
removed in the package breaks no script silently (``probe_fresh_recv.py`` imported a constant
from ``mpickpt.local.filemap`` for a session after it had moved to ``mpickpt.format.pages``).
The scripts themselves are not run (they start MPI and take minutes)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def mpickpt_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name or None) for every ``import mpickpt...`` and ``from mpickpt... import``."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "mpickpt" or node.module.startswith("mpickpt.")):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "mpickpt"]
    return out


@pytest.mark.quick
def test_the_bench_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 20 and any(p.name == "bench_levels.py" for p in SCRIPTS)
    assert mpickpt_imports(BENCH / "probe_fresh_recv.py")


@pytest.mark.quick
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_mpickpt_name_a_script_imports_exists(script: Path) -> None:
    for module, name in mpickpt_imports(script):
        mod = importlib.import_module(module)
        if name is None or name == "*":
            continue
        if not hasattr(mod, name):  # a submodule, imported by name
            importlib.import_module(f"{module}.{name}")
