"""One job saves into a ROOT at a time: a second job's first save is refused on every rank,
naming the first; a job that only restores is never refused, and removes nothing a live job is
writing."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpickpt.format import rootdir, rootlock, rootstart
from mpickpt.mpi.backend import MPI_LAUNCHER_VARS, PEER_VARS

PY = sys.executable
LOG = logging.getLogger("test-rootlock")


def _clean_env() -> dict[str, str]:
    """This environment less every sign of peers: a process started with it runs alone."""
    return {k: v for k, v in os.environ.items()
            if k not in (*MPI_LAUNCHER_VARS, *PEER_VARS, "SLURM_STEP_NUM_TASKS",
                         "MPICKPT_BACKEND")}

# holds ROOT's lock the way another job's rank 0 does (or a bare flock of the directory, with
# "raw", or of a file opened for writing, with "file"), says "HELD", and lets go when its stdin
# closes
HOLDER = r"""
import fcntl, os, sys
root, how = sys.argv[1], sys.argv[2]
if how in ("raw", "file"):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY if how == "raw" else os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    import logging
    from mpickpt.format import rootlock
    assert rootlock.take(root, logging.getLogger())[0] is None
print("HELD", flush=True)
sys.stdin.read()
"""


def _hold(root: Path, how: str = "mpickpt") -> subprocess.Popen[str]:
    p = subprocess.Popen([PY, "-c", HOLDER, str(root), how], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "HELD", line
    return p


# exit 7 where another process holds an exclusive lock on the path (a directory, or a file
# opened for writing), 0 where this one could take it
PROBE = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY if sys.argv[2] == "dir" else os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(7)
"""


def _others_can_lock(path: Path, kind: str = "dir") -> bool:
    """Whether another process could take an exclusive lock on ``path`` now."""
    code = subprocess.run([PY, "-c", PROBE, str(path), kind], timeout=60).returncode
    assert code in (0, 7), code
    return code == 0


def _let_go(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(timeout=60) == 0


@pytest.mark.quick
def test_the_lock_is_this_process_s_until_its_last_take_lets_go(tmp_path: Path) -> None:
    busy, first = rootlock.take(str(tmp_path), LOG)
    assert busy is None
    busy, second = rootlock.take(str(tmp_path), LOG)  # another Checkpointer, same process
    assert busy is None
    assert not rootlock.free(str(tmp_path))
    first()
    first()  # twice is once
    assert not rootlock.free(str(tmp_path))
    assert not _others_can_lock(tmp_path)
    second()
    assert rootlock.free(str(tmp_path))
    assert _others_can_lock(tmp_path)
    assert os.listdir(tmp_path) == []  # nothing written for it


def test_another_process_s_lock_is_named(tmp_path: Path) -> None:
    for how in ("mpickpt", "raw"):
        p = _hold(tmp_path, how)
        busy, release = rootlock.take(str(tmp_path), LOG)
        assert busy is not None and busy.startswith(f"process {p.pid} (") \
            and busy.endswith(" on this host"), busy
        release()  # refused: nothing to let go, and nothing let go
        assert not rootlock.free(str(tmp_path))
        _let_go(p)
        assert rootlock.free(str(tmp_path))
    busy, release = rootlock.take(str(tmp_path), LOG)
    assert busy is None
    release()


def _nfs_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks as an NFS mount takes them: no directory, and an exclusive one only on a file
    opened for writing (the client emulates flock with byte-range locks)."""
    real = rootlock._locked

    def nfs(fd: int, how: int = fcntl.LOCK_EX) -> bool | None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            return None
        if how == fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            return None
        return real(fd, how)

    monkeypatch.setattr(rootlock, "_locked", nfs)


def test_where_a_directory_cannot_be_locked_a_file_in_it_is(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _nfs_like(monkeypatch)
    busy, release = rootlock.take(str(tmp_path), LOG)
    assert busy is None and os.listdir(tmp_path) == [rootlock.NAME]
    path = tmp_path / rootlock.NAME
    assert not _others_can_lock(path, "file")
    release()
    assert rootlock.free(str(tmp_path))
    # another process's lock on the file (another job on another NFS client, say) is seen
    holder = _hold(path, "file")
    assert not rootlock.free(str(tmp_path))
    assert rootlock.take(str(tmp_path), LOG)[0] is not None
    _let_go(holder)
    assert rootlock.free(str(tmp_path))


def test_a_root_given_as_a_symbolic_link_is_the_directory_it_names(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    p = _hold(real)
    assert not rootlock.free(str(link))
    busy = rootlock.take(str(link), LOG)[0]
    assert busy is not None and busy.startswith(f"process {p.pid} ("), busy
    assert rootlock.who(str(link)) == busy
    _let_go(p)
    assert rootlock.free(str(link))


# the child only reads a pipe, opens, locks and closes files, and exits (os._exit)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_keeps_no_lock_of_its_parent(tmp_path: Path) -> None:
    """A DataLoader worker forked while the lock is held: the lock goes at the parent's
    release, and the child cannot take it for itself without the lock being free."""
    busy, release = rootlock.take(str(tmp_path), LOG)
    assert busy is None
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: wait for the word, then report what it finds
        os.close(w)
        os.read(r, 1)
        os._exit(0 if rootlock.free(str(tmp_path)) else 3)
    os.close(r)
    try:
        release()
        assert _others_can_lock(tmp_path)
    finally:
        os.write(w, b"x")
        os.close(w)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_start_removes_no_half_written_step_of_a_live_job(tmp_path: Path) -> None:
    other = _hold(tmp_path)
    partial = tmp_path / "step-00000010.partial-otherrun"
    partial.mkdir()
    (partial / "rank-00000.h5").write_bytes(b"x" * 10)
    going = tmp_path / "step-00000005.deleting-otherrun"
    going.mkdir()
    assert rootstart.prepare(str(tmp_path), "mine", LOG) is None
    assert partial.is_dir() and going.is_dir()  # the live job's
    _let_go(other)
    assert rootstart.prepare(str(tmp_path), "mine", LOG) is None
    assert not partial.exists() and not going.exists()  # a dead run's: removed


ALONE = r"""
import sys, torch, mpickpt
root, step = sys.argv[1], int(sys.argv[2])
m = torch.nn.Linear(16, 8)
ck = mpickpt.Checkpointer(root, keep=3)
assert type(ck._proto.comm).__name__ == "SelfComm"
if step == 0:  # only restore: never refused
    print("RESTORED", ck.restore({"model": m}), flush=True)
    ck.close()
    sys.exit(0)
try:
    ck.save(step, {"model": m}).wait()
except mpickpt.RootInUseError as e:
    print("REFUSED", e, flush=True)
    ck.close()
    sys.exit(5)
print("SAVED", step, flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "stay":  # stay, holding ROOT, until told
    sys.stdin.read()
ck.close()
if len(sys.argv) > 3 and sys.argv[3] == "closed":  # stay after close(), until told
    print("CLOSED", flush=True)
    sys.stdin.read()
"""


def _alone(root: Path, step: int, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-c", ALONE, str(root), str(step)], env=_clean_env(),
                          capture_output=True, text=True, timeout=180, **kw)  # type: ignore


def test_two_processes_alone_on_one_root_the_second_save_is_refused(tmp_path: Path) -> None:
    """What a launcher mpickpt does not recognise gives: every rank thinks it is rank 0 of 1."""
    first = subprocess.Popen([PY, "-c", ALONE, str(tmp_path), "10", "stay"], env=_clean_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline().split() == ["SAVED", "10"]
    second = _alone(tmp_path, 20)
    assert second.returncode == 5, second.stdout + second.stderr
    assert f"process {first.pid} (" in second.stdout and "MPICKPT_BACKEND=mpi" in second.stdout
    assert [s for s, _ in rootdir.committed(str(tmp_path))] == [10]  # nothing written, lost
    reader = _alone(tmp_path, 0)
    assert reader.returncode == 0 and "RESTORED 10" in reader.stdout, reader.stderr
    first.stdin.close()
    assert first.wait(timeout=120) == 0
    after = _alone(tmp_path, 20)  # the first one ended: ROOT is free again
    assert after.returncode == 0 and "SAVED 20" in after.stdout, after.stderr
    assert [s for s, _ in rootdir.committed(str(tmp_path))] == [20, 10]
    assert not any(".partial-" in n for n in os.listdir(tmp_path))


def test_a_killed_holder_frees_root(tmp_path: Path) -> None:
    first = subprocess.Popen([PY, "-c", ALONE, str(tmp_path), "10", "stay"], env=_clean_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None
    assert first.stdout.readline().split() == ["SAVED", "10"]
    first.kill()
    first.wait(timeout=60)
    after = _alone(tmp_path, 20)
    assert after.returncode == 0 and "SAVED 20" in after.stdout, after.stderr


def test_close_lets_the_lock_go_while_the_process_lives_on(tmp_path: Path) -> None:
    job = subprocess.Popen([PY, "-c", ALONE, str(tmp_path), "10", "closed"], env=_clean_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None and job.stdin is not None
    assert job.stdout.readline().split() == ["SAVED", "10"]
    assert job.stdout.readline().strip() == "CLOSED"
    try:
        assert rootlock.free(str(tmp_path))
        busy, release = rootlock.take(str(tmp_path), LOG)
        assert busy is None
        release()
    finally:
        job.stdin.close()
        assert job.wait(timeout=120) == 0


def test_a_drain_into_a_root_unusable_at_the_start_takes_the_lock(tmp_path: Path) -> None:
    """A job whose ROOT could not be used at its start saves on the nodes and drains into ROOT
    once it is back: the first drain takes the lock, and is refused while another job holds it."""
    from mpickpt.mpi.protocol import Protocol
    from mpickpt.save.retention import Policy
    from mpickpt.save.rootstore import RootStore
    from mpickpt.save.shards import RankShards, ShardOptions
    from mpickpt.save.upkeep import Upkeep

    root, node = tmp_path / "root", tmp_path / "node" / "step-00000005"
    root.mkdir()
    node.mkdir(parents=True)
    (node / "rank-00000.h5").write_bytes(b"shard" * 100)
    proto = Protocol(None, timeout=30)
    store = RootStore(proto, str(root), "run1", RankShards(0, 1, ShardOptions(), None, LOG),
                      Upkeep(str(root), "run1", Policy.of(2, None, None, 0), LOG), LOG)
    partial = str(root / "step-00000005.partial-run1")
    try:
        p = _hold(root)
        why = store.copy_in(str(node), partial, 5, {}, None)
        assert why is not None and f"process {p.pid} (" in why and "another job" in why, why
        assert os.listdir(root) == []  # nothing written
        _let_go(p)
        assert store.copy_in(str(node), partial, 5, {}, None) is None
        assert (Path(partial) / "rank-00000.h5").read_bytes() == b"shard" * 100
        assert not rootlock.free(str(root))  # held by this job until its communicator goes
    finally:
        proto.free()
    assert rootlock.free(str(root))



MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /scratch rw,relatime shared:7 - nfs4 fs1:/scratch rw,vers=4.2,local_lock=flock
41 22 0:51 / /lus rw - lustre 10.0.0.2@o2ib:/lus rw,localflock
42 22 0:52 / /lus/ok rw - lustre 10.0.0.2@o2ib:/lus2 rw,flock
43 22 0:53 / /my\\040dir rw - nfs fs2:/d rw,local_lock=all
44 40 0:54 / /scratch rw - nfs4 fs1:/scratch2 rw,local_lock=none
45 22 0:55 / /home rw - nfs fs3:/home rw,local_lock=none
not a mountinfo line
"""


def test_a_mount_that_keeps_locks_per_host_is_told_apart(tmp_path: Path) -> None:
    from mpickpt.format import mounts

    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    t = str(table)
    assert mounts.per_host_locks("/lus/run1", t) == "lustre mounted localflock at /lus"
    assert mounts.per_host_locks("/lus/ok/run1", t) is None  # a longer mount point, flock
    assert mounts.per_host_locks("/my dir/ckpt", t) == "nfs mounted local_lock=all at /my dir"
    assert mounts.per_host_locks("/scratch/x", t) is None  # mounted over by a local_lock=none
    assert mounts.per_host_locks("/scratchy", t) is None  # not under /scratch
    assert mounts.per_host_locks("/home/u", t) is None
    assert mounts.mount_of("/usr", t) == mounts.Mount("/", "8:1", "ext4", ("rw", "relatime",
                                                                             "rw"))
    assert mounts.mount_of("/usr", str(tmp_path / "none")) is None
    # a mount hidden by a later one over a shorter point: the path's device tells them apart
    sub = (tmp_path / "sub").resolve()
    sub.mkdir()
    st = os.stat(tmp_path).st_dev
    real = f"{os.major(st)}:{os.minor(st)}"
    table.write_text(f"1 0 {real} / / rw - ext4 /dev/x rw\n"
                     f"2 1 0:9999 / {sub} rw - nfs s:/a rw,local_lock=all\n"
                     f"3 1 {real} / {tmp_path.resolve()} rw - nfs s:/b rw,local_lock=none\n")
    assert mounts.per_host_locks(str(tmp_path / "sub"), t) is None
    assert mounts.mount_of(str(tmp_path / "sub"), t).point == str(tmp_path.resolve())


def test_taking_the_lock_on_such_a_mount_says_a_job_on_another_host_is_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mpickpt.format import mounts

    root = tmp_path / "root"
    root.mkdir()
    with caplog.at_level(logging.WARNING, logger=LOG.name):  # this machine's own mounts
        busy, release = rootlock.take(str(root), LOG)
        release()
    assert busy is None and "kept per host" not in caplog.text
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                     f"40 22 0:50 / {root.resolve()} rw - nfs4 fs1:/x rw,local_lock=flock\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(table))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        busy, release = rootlock.take(str(root), LOG)
        again, release_again = rootlock.take(str(root), LOG)  # the process holds it: said once
        release_again()
        release()
    assert busy is None and again is None
    said = [r.getMessage() for r in caplog.records if "kept per host" in r.getMessage()]
    assert len(said) == 1 and "nfs4 mounted local_lock=flock" in said[0], said
    assert "only on this host" in said[0]
