"""The CLI starts without torch and without MPI; ``import mpickpt`` is lazy and complete.

Each case runs in a fresh interpreter (sys.modules of this process already hold torch), with the
launcher's environment variables removed, as when an operator types the command in a shell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from clikit import pristine

import mpickpt
from mpickpt.cli.team import LAUNCH_ENV

HEAVY = ("torch", "mpi4py", "mpi4py.MPI")

PROBE = """
import contextlib, io, json, sys
entry, argv = sys.argv[1], json.loads(sys.argv[2])
if entry == "restore":
    from mpickpt.cli.restore import main
else:
    from mpickpt.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
watch = set(HEAVY) | {"h5py", "numpy"}
print(json.dumps({"code": code, "out": out.getvalue(),
                  "loaded": sorted(m for m in sys.modules if m in watch),
                  "ours": sorted(m for m in sys.modules if m.startswith("mpickpt"))}))
""".replace("HEAVY", repr(HEAVY))


def run_probe(entry: str, *argv: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    p = subprocess.run([sys.executable, "-c", PROBE, entry, json.dumps(list(argv))],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("argv", [
    ("main", "--help"), ("main", "--version"), ("main", "ls", "ROOT"),
    ("main", "ls", "ROOT", "--json"), ("main", "verify", "ROOT"),
    ("main", "verify", "ROOT", "--verify", "quick"), ("main", "inspect", "ROOT", "--tree"),
    ("main", "stats", "ROOT"), ("main", "restore", "ROOT", "--list"),
    ("restore", "--help"), ("restore", "--version"), ("restore", "ROOT", "--list"),
    ("restore", "ROOT", "--dry-run"), ("restore", "ROOT", "--dry-run", "--prune", "--keep", "1"),
    ("restore", "ROOT", "--verify", "full", "--dry-run"),
], ids=lambda a: " ".join(a))
def test_commands_import_neither_torch_nor_mpi(tmp_path_factory, argv):
    root = str(pristine(2, tmp_path_factory))
    got = run_probe(argv[0], *(root if a == "ROOT" else a for a in argv[1:]))
    assert got["code"] == 0, got
    assert not [m for m in got["loaded"] if m in HEAVY], got["loaded"]
    # a prune reads the step it keeps in full
    full = "full" in argv or "--prune" in argv or ("verify" in argv and "quick" not in argv)
    if not full:  # only full verification reads HDF5 metadata (h5py, and with it numpy)
        assert "h5py" not in got["loaded"] and "numpy" not in got["loaded"], got["loaded"]


def test_version_of_both_commands():
    for entry in ("main", "restore"):
        got = run_probe(entry, "--version")
        assert got["code"] == 0 and got["out"] == f"mpickpt {mpickpt.__version__}\n"
    assert mpickpt.__version__ == "0.1.0"
    # mpickpt --version answers before the commands' modules are imported
    assert len(run_probe("main", "--version")["ours"]) <= 8


def test_export_still_imports_torch(tmp_path, tmp_path_factory):
    root = str(pristine(1, tmp_path_factory))
    got = run_probe("main", "export", root, str(tmp_path / "m.pt"))
    assert got["code"] == 0 and "torch" in got["loaded"]


@pytest.mark.quick
def test_import_mpickpt_is_lazy_and_every_name_still_imports():
    code = """
import sys, json
import mpickpt
before = "torch" in sys.modules
listed = set(dir(mpickpt))
from mpickpt import *  # noqa
from mpickpt import Checkpointer, Piece, RNGState, RestoreInfo, SaveHandle, SaveResult, Shard
import mpickpt.checkpointer, mpickpt.restore.restorer, mpickpt.sharding, mpickpt.stateful
print(json.dumps({
    "before": before, "after": "torch" in sys.modules,
    "missing_from_dir": sorted(set(mpickpt.__all__) - listed),
    "same": [getattr(mpickpt, n) is getattr(m, n) for n, m in [
        ("Checkpointer", mpickpt.checkpointer), ("SaveHandle", mpickpt.checkpointer),
        ("SaveResult", mpickpt.checkpointer), ("RestoreInfo", mpickpt.restore.restorer),
        ("Piece", mpickpt.sharding), ("Shard", mpickpt.sharding),
        ("RNGState", mpickpt.stateful), ("Values", mpickpt.stateful)]],
    "star": sorted(n for n in mpickpt.__all__ if n not in globals()),
    "submodule": mpickpt.format.rootdir.__name__, "version": mpickpt.__version__}))
"""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["before"] is False and got["after"] is True
    assert got["missing_from_dir"] == [] and got["star"] == []
    assert all(got["same"]) and got["submodule"] == "mpickpt.format.rootdir"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = mpickpt.nothing_here
