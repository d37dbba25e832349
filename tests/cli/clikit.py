"""Helpers of the CLI tests: real checkpoint trees, ways to damage them, and the CLI run in-process.

A tree is what a crash leaves: examples/train.py on N ranks (1, 2 or 4) checkpoints every 5 steps
with keep=3 and is killed (SIGKILL of one rank) in the middle of writing step 25, so ROOT holds
committed steps 10, 15 and 20, the dead run's ``step-00000025.partial-<run>/`` and stats.jsonl.
Each tree is made once per session and copied for every test that changes it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from harness import step_dir, train

from mpickpt.cli import main as cli_main
from mpickpt.cli import restore as cli_restore
from mpickpt.format import rootdir

COMMITTED = [20, 15, 10]
PARTIAL = 25
_KILLED_RANK = {1: 0, 2: 1, 4: 2}
_trees: dict[int, Path] = {}


def pristine(n: int, factory: pytest.TempPathFactory) -> Path:
    """The crash-left tree of an ``n``-rank run (made on first use; do not modify it)."""
    if n not in _trees:
        root = factory.mktemp(f"cli-tree-{n}") / "ckpt"
        job = train(n, root, PARTIAL, every=5, keep=3,
                    fault=f"mid-write:{_KILLED_RANK[n]}:kill:{PARTIAL}", timeout=120)
        assert job.returncode != 0, job.output  # the kill ended the job
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))[:3] == [
            f"step-{s:08d}" for s in sorted(COMMITTED)], job.output
        assert partial_dirs(root), job.output
        _trees[n] = root
    return _trees[n]


def copy_tree(n: int, factory: pytest.TempPathFactory, dst: Path) -> Path:
    """A private copy of the ``n``-rank tree at ``dst``, its partial directory made old (so that
    the default --grace takes it for a dead run's)."""
    shutil.copytree(pristine(n, factory), dst)
    for p in partial_dirs(dst):
        age(p, 3600)
    return dst


def age(path: Path, seconds: float) -> None:
    """Set the mtime of ``path`` and everything directly in it ``seconds`` back."""
    t = os.stat(path).st_mtime - seconds
    for p in [path, *path.iterdir()]:
        os.utime(p, (t, t), follow_symlinks=False)


def partial_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if ".partial-" in p.name)










def garble_manifest(root: Path, step: int) -> Path:
    path = step_dir(root, step) / "MANIFEST.json"
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2] + b"\x00 garbage }{" + text[len(text) // 2 + 12:])
    return path


def cli(*argv: str | Path, restore: bool = False) -> tuple[int, str, str]:
    """Run ``mpickpt ARGV`` (or ``mpickpt-restore ARGV``) in this process: (code, out, err)."""
    out, err = io.StringIO(), io.StringIO()
    entry = cli_restore.main if restore else cli_main.main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = entry([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def cli_json(*argv: str | Path, restore: bool = False) -> tuple[int, dict[str, Any]]:
    """Run with --json: (code, the JSON object); stdout must hold exactly one JSON object."""
    code, out, err = cli(*argv, "--json", restore=restore)
    doc = json.loads(out)
    assert doc["exit_code"] == code, (doc, err)
    return code, doc


def by_step(doc: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    """The checkpoints of a JSON report by (step, status)."""
    return {(c["step"], c["status"]): c for c in doc["checkpoints"]}




def listing(root: Path) -> list[str]:
    """Names directly under ROOT and under ROOT/quarantine/, sorted; not ROOT/.pool, the shards
    retention retired (which the next save writes over; no command touches it)."""
    names = [p.name for p in root.iterdir() if p.name != rootdir.POOL]
    q = root / "quarantine"
    if q.is_dir():
        names += [f"quarantine/{p.name}" for p in q.iterdir()]
    return sorted(names)

