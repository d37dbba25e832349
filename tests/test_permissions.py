"""File modes: everything mpickpt and its tools create in ROOT honours the umask and is never
world-writable, even under ``umask 000``; the node-local level is private to the job's user.

A real 2-rank job (ROOT two directories deeper than what exists) checkpoints under each umask; then
mpickpt-restore quarantines a damaged checkpoint and rolls back, and mpickpt export writes both
formats, under the same umask. Every directory must then have mode 0o777 and every file 0o666, less
the umask, less world-write.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import SCENARIOS, Job, flip_data_byte, run_mpi, train

from mpickpt.cli import main as cli_main
from mpickpt.cli import restore as cli_restore
from mpickpt.format import rootdir

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


# ---------------------------------------------------------------- the node-local level: private

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command as the user nobody: another user of the node."""
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=30)


def level_job(tmp: Path, local: Path, n: int = 4) -> Job:
    """tests/scenarios/levels.py: 4 ranks on two simulated nodes, partner copies, steps 10, 20."""
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"root": str(tmp / "root"), "local": str(local), "per_node": 2,
                                "redundancy": "partner", "steps": 20, "every": 10,
                                "persist_every": None}))
    return run_mpi(n, [str(SCENARIOS / "levels.py"), str(plan)], timeout=120)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh name in /dev/shm (every user's to create in, as on a cluster's node)."""
    where = Path(f"/dev/shm/mpickpt-test-{uuid.uuid4().hex[:8]}")
    yield where
    subprocess.run(["rm", "-rf", str(where)], check=True)


@pytest.fixture
def no_setpriv() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to act as another user")


def test_the_local_level_is_private_to_the_jobs_user_whatever_the_umask(
        tmp_path: Path, shm: Path, no_setpriv: None) -> None:
    """With umask 022 ROOT is readable by all, the local level by the job's user only: 0700
    directories, 0600 files (shards, partner copies, manifests, the recycled files of .pool/);
    another user can neither list it nor read a shard."""
    with umask(0o022):
        job = level_job(tmp_path, shm)
    assert job.returncode == 0, job.output
    found = modes(shm)
    shards = [p for p in found if p.endswith(".h5") and "/.pool/" not in p]
    assert len(shards) == 8, sorted(found)  # each node: its 2 ranks' shards and 2 copies
    pooled = [p for p in found if "/.pool/" in p and p.endswith(".h5")]
    assert len(pooled) == 8, sorted(found)  # and the files of the step it retired, recycled
    wrong = {p: oct(m) for p, (d, m) in found.items() if m != (0o700 if d else 0o600)}
    assert not wrong, wrong
    assert stat.S_IMODE((tmp_path / "root" / "step-00000020").stat().st_mode) == 0o755
    for argv in (["ls", str(shm)], ["cat", shards[0]], ["ls", str(shm / "n0")]):
        p = as_nobody(*argv)
        assert p.returncode != 0 and "Permission denied" in p.stderr, (argv, p)


@pytest.mark.parametrize("planted", ["directory", "link"])
def test_a_directory_or_link_planted_by_another_user_is_refused(
        tmp_path: Path, shm: Path, no_setpriv: None, planted: str) -> None:
    """Another user creates the level's predictable name first (a directory they own, or a link
    to a directory they can read): every rank refuses at construction, naming it; nothing of
    the state is written there."""
    trap = tmp_path / "trap"
    trap.mkdir(mode=0o777)
    trap.chmod(0o777)
    made = as_nobody("mkdir", "-m", "777", str(shm)) if planted == "directory" else \
        as_nobody("ln", "-s", str(trap), str(shm))
    assert made.returncode == 0, made.stderr
    job = level_job(tmp_path, shm)
    assert job.returncode != 0
    why = "belongs to user 65534" if planted == "directory" else "is a symbolic link"
    assert why in job.stderr and str(shm) in job.stderr, job.output
    assert list(trap.iterdir()) == []
    if planted == "directory":
        assert list(shm.iterdir()) == []
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").glob("step-*"))


def test_an_own_directory_with_wider_permissions_is_narrowed(tmp_path: Path) -> None:
    """A local directory of the job's user made earlier with the umask's modes (0755) becomes
    0700; the files made under it then are 0600."""
    base = tmp_path / "local"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    rootdir.make_private(str(base))
    with umask(0):
        rootdir.make_dirs(str(base / "n0" / "step-00000010"))
        rootdir.atomic_write(str(base / "n0" / "step-00000010" / "MANIFEST.json"), b"{}")
    assert {os.path.relpath(p, base): m for p, (_, m) in modes(base).items()} == {
        ".": 0o700, "n0": 0o700, "n0/step-00000010": 0o700,
        "n0/step-00000010/MANIFEST.json": 0o600}
