"""The package's shape, as the architecture asks for it: no module over 450 lines, no class over
300, no function over 80 outside the operator's CLI (whose commands read top to bottom), and no
module of a lower folder importing one of a higher (the save path, the node-local level and the
restore path stand on the format and the protocol layer, never the other way)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpickpt"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 300, 80
# a folder may import those after it in this list, never those before it
LAYERS = ["cli", "restore", "local", "save", "format", "mpi"]


def sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_class_or_function_is_too_long():
    too_long = []
    for name, tree in sources().items():
        lines = len((PACKAGE / name).read_text().splitlines())
        if lines > MAX_MODULE:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                too_long.append(f"{name}: class {node.name}, {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and size > MAX_FUNCTION and not name.startswith("cli/"):
                too_long.append(f"{name}: {node.name}(), {size} lines")
    assert too_long == []


def test_no_folder_imports_one_above_it():
    upward = []
    for name, tree in sources().items():
        here = name.split("/")[0]
        if here not in LAYERS:
            continue
        package = ["mpickpt", *name.split("/")[:-1]]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
            else:
                target = (node.module or "").split(".")
            if target[:1] != ["mpickpt"] or len(target) < 2 or target[1] not in LAYERS:
                continue
            if LAYERS.index(target[1]) < LAYERS.index(here):
                upward.append(f"{name} imports {'.'.join(target)}")
    assert upward == []
