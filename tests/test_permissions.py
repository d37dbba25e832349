"""File modes: everything mpickpt and its tools create honours the umask and is never
world-writable, even under ``umask 000``.

A real 2-rank job (ROOT two directories deeper than what exists) checkpoints under each umask; then
mpickpt-restore quarantines a damaged checkpoint and rolls back, and mpickpt export writes both
formats, under the same umask. Every directory must then have mode 0o777 and every file 0o666, less
the umask, less world-write.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import flip_data_byte, train

from mpickpt import rootdir
from mpickpt.cli import main as cli_main
from mpickpt.cli import restore as cli_restore

pytestmark = pytest.mark.guarantee("umask-honoured")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def expected(mask: int, directory: bool) -> int:
    return (0o777 if directory else 0o666) & ~mask & ~0o002


def modes(*tops: Path) -> dict[str, tuple[bool, int]]:
    """Path -> (is a directory, permission bits) of ``tops`` and everything under them."""
    out = {}
    for top in tops:
        for p in [top, *top.rglob("*")]:
            st = p.lstat()
            assert not stat.S_ISLNK(st.st_mode), p
            out[str(p)] = (stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode))
    return out


def run(*argv: str | Path, restore: bool = False) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    entry = cli_restore.main if restore else cli_main.main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = entry([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("mask", [0o077, 0o022, 0o000], ids=["077", "022", "000"])
def test_every_file_and_directory_honours_the_umask(tmp_path: Path, mask: int) -> None:
    base = tmp_path / "new"  # does not exist: the Checkpointer creates it and its child
    root = base / "deeper" / "ckpt"
    exports = tmp_path / "exports"
    exports.mkdir(mode=0o700)
    with umask(mask):
        job = train(2, root, 15, every=5, keep=3, timeout=120)
        assert job.returncode == 0, job.output
        flip_data_byte(root, 15, rank=1)
        code, out = run(root, "--verify", "full", restore=True)  # quarantines step 15
        assert code == 0, out
        code, out = run(root, "--step", "5", restore=True)  # quarantines 10, ROLLBACK.json
        assert code == 0, out
        code, out = run("export", root, exports / "model", "--step", "5")
        assert code == 0, out
    found = modes(base, exports / "model.pt", exports / "model.safetensors")
    names = {os.path.relpath(p, base) for p in found}
    for want in ("deeper", "deeper/ckpt", "deeper/ckpt/stats.jsonl", "deeper/ckpt/ROLLBACK.json",
                 "deeper/ckpt/quarantine", "deeper/ckpt/quarantine/QUARANTINE.jsonl",
                 "deeper/ckpt/quarantine/step-00000015/rank-00001.h5",
                 "deeper/ckpt/quarantine/step-00000010/MANIFEST.json",
                 "deeper/ckpt/step-00000005/rank-00000.h5"):
        assert want in names, sorted(names)
    wrong = {p: oct(m) for p, (d, m) in found.items() if m != expected(mask, d)}
    assert not wrong, f"umask {mask:03o}: want {oct(expected(mask, True))} for directories, " \
                      f"{oct(expected(mask, False))} for files: {wrong}"


def test_helpers_never_make_world_writable_entries(tmp_path: Path) -> None:
    with umask(0):
        rootdir.make_dirs(str(tmp_path / "a" / "b"))
        rootdir.atomic_write(str(tmp_path / "a" / "b" / "f"), b"x")
    for p, directory in ((tmp_path / "a", True), (tmp_path / "a" / "b", True),
                         (tmp_path / "a" / "b" / "f", False)):
        assert stat.S_IMODE(p.stat().st_mode) == (0o775 if directory else 0o664), p
